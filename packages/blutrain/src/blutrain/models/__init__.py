"""blutrain.models"""
