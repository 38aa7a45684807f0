"""blutrain.nn"""
