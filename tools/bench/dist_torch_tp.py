"""PyTorch's own tensor parallelism of tools/bench/gpt2.py's GPT-2, for tools/bench/dist.py's ``--torch-modes tp``
and ``tp-async``: DTensor's ``parallelize_module`` over a 1-D DeviceMesh of every rank, each rank on the same rows.

The plan (``parallelize_gpt2``), the Megatron layout as torchtitan's per-model ``parallelize`` functions write it:

- each block: the attention's q/k/v projection and the MLP's fc ``ColwiseParallel``, their output projections
  ``RowwiseParallel``; each rank keeps n_head / N whole heads (the attention reshapes with -1).
- the token embedding vocab-parallel (``RowwiseParallel``, its output all-reduced) and the LM head vocab-parallel
  (``ColwiseParallel``, logits left sharded over the vocabulary for ``loss_parallel``), tied again after both are
  sharded (both hold the weight as ``Shard(0)`` over the vocabulary), as BluTrain's tp cuts them.
- ``tp``: the LayerNorms and the position embedding replicated (``distribute_module``: DTensor parameters, plain
  tensors in and out), so every parameter is a DTensor and one fused AdamW and one global-norm clip take them all.
- ``tp-async``: the same with sequence parallelism (torchtitan's plan: the LayerNorms ``SequenceParallel``, each
  attention and MLP gathering the sequence on entry, each output projection reduce-scattering it), the layout
  whose all-gather → matmul and matmul → reduce-scatter inductor's micro-pipeline TP pass
  (``torch._inductor.config._micro_pipeline_tp``) decomposes over symmetric memory: compiled only, CUDA only.

The fused q/k/v projection holds q, k and v one after the other; ``ColwiseParallel`` cuts its rows into N
contiguous parts, so before the cut its rows are reordered to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (rank r's
heads of each), and the attention splits its local product into three equal parts. On one rank that order is the
original one, and on N the model computes the same function: the losses match the one-GPU run's up to rounding.
PyTorch is imported by the caller (a rank of tools/bench/dist_worker.py) and passed in.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


def dtensor() -> Any:
    """``torch.distributed.tensor`` (DTensor, its placements, ``distribute_module``)."""
    return importlib.import_module("torch.distributed.tensor")


class TensorParallelUnavailableError(RuntimeError):
    """This PyTorch, device or implementation cannot run the asked mode: its row is skipped, saying why."""


@dataclass
class TorchTensorParallel:
    """A model parallelized in place over ``mesh``: what its training step needs beside it."""

    torch: Any
    mesh: Any
    parameters: list[Any]

    @contextlib.contextmanager
    def loss_context(self) -> Iterator[None]:
        """Around forward and backward: the cross-entropy of vocabulary-sharded logits (``loss_parallel``)."""
        parallel: Any = importlib.import_module("torch.distributed.tensor.parallel")
        with parallel.loss_parallel():
            yield

    def local_loss(self, loss: Any) -> Any:
        """The loss as a plain tensor (a replicated DTensor's local value: the same on every rank)."""
        return loss.to_local() if isinstance(loss, dtensor().DTensor) else loss

    def clip(self, max_norm: float) -> Any:
        """Clip to a global gradient norm over sharded and replicated DTensors (torchtitan's order: the total
        norm, made a plain tensor, then every gradient scaled by it)."""
        utils = self.torch.nn.utils
        grads = [p.grad for p in self.parameters if p.grad is not None]
        total = utils.get_total_norm(grads, 2.0)
        total = total.full_tensor() if isinstance(total, dtensor().DTensor) else total
        utils.clip_grads_with_norm_(self.parameters, max_norm, total)
        return total


def tensor_parallel(torch: Any, model: Any, cfg: Any, family: str, world: int, device_type: str, seq_len: int,
                    sequence_parallel: bool) -> TorchTensorParallel:
    """``model`` (tools/bench/gpt2.py's ``TORCH_MODELS[family]``, built identically on every rank) parallelized in
    place over all ``world`` ranks; ``sequence_parallel``: tp-async's layout."""
    plan = PLANS.get(family)
    if plan is None:
        raise TensorParallelUnavailableError(f"--torch-modes tp has a plan for {', '.join(PLANS)}, not for {family!r}")
    heads, vocab = int(cfg.n_head), int(cfg.vocab_size)
    if heads % world or vocab % world or (sequence_parallel and seq_len % world):
        raise ValueError(f"tensor parallelism over {world} ranks needs n_head ({heads}), vocab_size ({vocab})"
                         + (f" and the sequence ({seq_len})" if sequence_parallel else "")
                         + f" divisible by {world}; give a --sizes whose counts divide them")
    mesh_api: Any = importlib.import_module("torch.distributed.device_mesh")
    mesh = mesh_api.init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
    plan(torch, model, mesh, sequence_parallel)
    return TorchTensorParallel(torch, mesh, list(model.parameters()))


def check_async_tp(torch: Any, compiled: bool, cuda: bool) -> None:
    """Raise :class:`TensorParallelUnavailableError`, saying why, where PyTorch's async TP cannot run: eager, off
    CUDA, or a PyTorch without inductor's micro-pipeline TP pass and symmetric memory."""
    if not compiled:
        raise TensorParallelUnavailableError("PyTorch's async TP is a torch.compile (inductor) pass: compiled only")
    if not cuda:
        raise TensorParallelUnavailableError("PyTorch's async TP needs CUDA symmetric memory: cuda only")
    if _micro_pipeline_tp_api() is None:
        raise TensorParallelUnavailableError(f"torch {torch.__version__} has no micro-pipeline TP "
                                        "(torch._inductor.config._micro_pipeline_tp, enable_symm_mem_for_group)")


def enable_async_tp(torch: Any, mesh: Any) -> None:
    """Inductor's micro-pipeline TP pass on, over symmetric memory for ``mesh``'s group (after
    :func:`check_async_tp`)."""
    api = _micro_pipeline_tp_api()
    if api is None:
        raise TensorParallelUnavailableError(f"torch {torch.__version__} has no micro-pipeline TP")
    inductor, enable = api
    inductor._micro_pipeline_tp = True
    enable(mesh.get_group().group_name)


def _micro_pipeline_tp_api() -> tuple[Any, Callable[[str], None]] | None:
    """(``torch._inductor.config``, ``enable_symm_mem_for_group``) where this PyTorch has both, else None."""
    inductor: Any = importlib.import_module("torch._inductor.config")
    try:
        symmetric: Any = importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return None
    enable = getattr(symmetric, "enable_symm_mem_for_group", None)
    if getattr(inductor, "_micro_pipeline_tp", None) is None or enable is None:
        return None
    return inductor, enable


def disable_async_tp() -> None:
    """The pass off again, so that the launch's next configuration compiles without it."""
    inductor: Any = importlib.import_module("torch._inductor.config")
    if getattr(inductor, "_micro_pipeline_tp", None) is not None:
        inductor._micro_pipeline_tp = False


def interleave_qkv(torch: Any, linear: Any, parts: int) -> None:
    """Reorder the fused q/k/v projection's output rows from ``[q | k | v]`` to ``[q_0 k_0 v_0 | q_1 k_1 v_1 |
    ...]`` for ``parts`` ranks, in place (the identity for one)."""
    rows = linear.weight.shape[0]
    order = torch.arange(rows, device=linear.weight.device).view(3, parts, rows // (3 * parts)).transpose(0, 1)
    order = order.reshape(-1)
    with torch.no_grad():
        linear.weight.copy_(linear.weight[order])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[order])


def replicate(module: Any, mesh: Any) -> None:
    """``module``'s parameters as replicated DTensors, its inputs and outputs plain tensors (torchtitan's
    ``NoParallel``): it computes in full on every rank, and its gradients, computed from the same upstream
    gradients on every rank, need no reduction."""
    dt = dtensor()

    def inputs_in(_module: Any, inputs: Any, device_mesh: Any) -> Any:
        return tuple(dt.DTensor.from_local(x, device_mesh, [dt.Replicate()], run_check=False)
                     if not isinstance(x, dt.DTensor) else x for x in inputs)

    def outputs_out(_module: Any, outputs: Any, _device_mesh: Any) -> Any:
        return outputs.to_local() if isinstance(outputs, dt.DTensor) else outputs

    dt.distribute_module(module, mesh, input_fn=inputs_in, output_fn=outputs_out)


def parallelize_gpt2(torch: Any, model: Any, mesh: Any, sequence_parallel: bool) -> None:
    """The plan of the module's doc for tools/bench/gpt2.py's GPT-2 (``transformer.{wte,wpe,h,ln_f}``,
    ``lm_head`` tied to ``wte``; each block ``ln_1``, ``attn.{c_attn,c_proj}``, ``ln_2``, ``mlp.{c_fc,c_proj}``)."""
    tp: Any = importlib.import_module("torch.distributed.tensor.parallel")
    dt = dtensor()
    replicated, sequence = dt.Replicate(), dt.Shard(1)
    t = model.transformer
    for block in t.h:
        interleave_qkv(torch, block.attn.c_attn, mesh.size())
        out = sequence if sequence_parallel else replicated  # a projection's sum: reduce-scatter or all-reduce
        plan: dict[str, Any] = {"attn.c_attn": tp.ColwiseParallel(),
                                "attn.c_proj": tp.RowwiseParallel(output_layouts=out),
                                "mlp.c_fc": tp.ColwiseParallel(), "mlp.c_proj": tp.RowwiseParallel(output_layouts=out)}
        if sequence_parallel:
            gather = tp.PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(replicated,))
            plan |= {"ln_1": tp.SequenceParallel(), "ln_2": tp.SequenceParallel(), "attn": gather, "mlp": gather}
        else:
            replicate(block.ln_1, mesh)
            replicate(block.ln_2, mesh)
        tp.parallelize_module(block, mesh, plan)
    root: dict[str, Any] = {
        "transformer.wte": tp.RowwiseParallel(input_layouts=replicated, output_layouts=replicated),
        "lm_head": tp.ColwiseParallel(input_layouts=sequence if sequence_parallel else replicated,
                                      output_layouts=dt.Shard(-1), use_local_output=False)}
    if sequence_parallel:  # the residual stream is cut over the sequence from the first block to the final norm
        root |= {"transformer.h.0": tp.PrepareModuleInput(input_layouts=(replicated,),
                                                          desired_input_layouts=(sequence,), use_local_output=True),
                 "transformer.ln_f": tp.SequenceParallel()}
    else:
        replicate(t.ln_f, mesh)
    replicate(t.wpe, mesh)
    tp.parallelize_module(model, mesh, root)
    model.lm_head.weight = t.wte.weight  # tied again: both are the same Shard(0) over the vocabulary


# the tensor-parallel plan of each family of tools/bench/gpt2.py's TORCH_MODELS that has one
PLANS: dict[str, Callable[[Any, Any, Any, bool], None]] = {"gpt2": parallelize_gpt2}

__all__ = ["PLANS", "TensorParallelUnavailableError", "TorchTensorParallel", "check_async_tp", "disable_async_tp",
           "enable_async_tp",
           "interleave_qkv", "parallelize_gpt2", "replicate", "tensor_parallel"]
