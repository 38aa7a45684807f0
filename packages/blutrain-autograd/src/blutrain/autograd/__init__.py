"""blutrain.autograd: reverse-mode automatic differentiation for blutrain tensors.

Importing it installs the recorder in op dispatch; tensors that require grad import it on demand.
"""

from blutrain.autograd import rules
from blutrain.autograd.checkpoint import checkpoint
from blutrain.autograd.engine import Node, backward, grad, in_backward, record
from blutrain.autograd.grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from blutrain.autograd.rules import RULES, Rule, derivative

__all__ = ["RULES", "Node", "Rule", "backward", "checkpoint", "derivative", "enable_grad", "grad",
           "in_backward", "is_grad_enabled", "no_grad", "record", "rules", "set_grad_enabled"]
