"""``--parallel``: one mode over every rank (``ddp``, ``zero=2``) or the sizes of a device mesh
(``dp=2,tp=2``, ``dp=2,cp=2,attn=ulysses``, ``tp=2,async=4``), parsed and checked before any rank starts work."""

from __future__ import annotations

import pytest

from blutrain.dist import ParallelMode, ParallelModeRegistry
from blutrain.tensor.plugins import hookimpl
from blutrain.tensor.testing import plugin_registered
from blutrain.train import ConfigError, ParallelPlan, TrainConfig, Trainer


def plan(text: str, **fields: object) -> ParallelPlan:
    cfg = TrainConfig(parallel=text, **fields)  # type: ignore[arg-type]
    cfg.validate()
    got = cfg.parallel_plan()
    assert got is not None
    return got


def refusal(text: str, **fields: object) -> str:
    cfg = TrainConfig(parallel=text, **fields)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    return str(info.value)


def test_no_parallel_is_no_plan() -> None:
    assert TrainConfig().parallel_plan() is None


@pytest.mark.parametrize(("text", "mode"), [("ddp", ("ddp", (), {})), ("ddp=25", ("ddp", (25,), {})),
                                            ("zero=2", ("zero", (2,), {})), ("ddp=0.5", ("ddp", (0.5,), {}))])
def test_a_mode_alone_runs_over_every_rank_with_its_value_as_first_option(text: str, mode: object) -> None:
    got = plan(text)
    assert got.mesh == {} and got.ranks is None
    assert got.modes == (mode,)


def test_dp_times_tp_rewrites_for_tp_first_then_averages_over_dp() -> None:
    got = plan("tp=2,dp=2")
    assert got.mesh == {"dp": 2, "tp": 2}  # dp outermost whatever the order given: tp ranks are neighbours
    assert got.ranks == 4
    assert got.modes == (("tp", (), {}), ("ddp", (), {}))


def test_dp_times_cp_passes_the_attention_to_cp() -> None:
    got = plan("dp=2,cp=2,attn=ulysses")
    assert got.mesh == {"dp": 2, "cp": 2}
    assert got.modes == (("cp", (), {"attn": "ulysses"}), ("ddp", (), {}))


def test_cp_times_tp_rewrites_for_tp_first_then_wraps_the_rewritten_model_in_cp() -> None:
    got = plan("tp=2,cp=2,attn=ulysses")
    assert got.mesh == {"cp": 2, "tp": 2} and got.ranks == 4
    assert got.modes == (("tp", (), {}), ("cp", (), {"attn": "ulysses"}))


class _RewritesAlone(ParallelMode):
    """A layer-rewriting mode on a mesh dimension of its own that cannot wrap a rewritten model."""

    dim = "xp"
    on_mesh = True
    mesh_order = 1
    rewrites_layers = True


class _ModePlugin:
    """A plugin that registers one parallel mode class under a name."""

    def __init__(self, name: str, mode: type[ParallelMode]) -> None:
        self.name, self.mode = name, mode

    @hookimpl
    def blutrain_register_parallel_modes(self, registry: ParallelModeRegistry) -> None:
        registry.register(self.name, self.mode)


def test_two_layer_rewriting_modes_compose_only_where_the_outer_one_wraps_rewritten_models() -> None:
    with plugin_registered(_ModePlugin("xp", _RewritesAlone), "rewrites-alone"):
        message = refusal("xp=2,tp=2")
    assert message == ("parallel 'xp=2,tp=2': xp and tp do not compose (xp rewrites the model's layers and cannot "
                       "wrap a model tp rewrote: it does not declare wraps_rewritten); give one of them, alone or "
                       "with the other dimensions")


@pytest.mark.parametrize(("text", "mesh", "modes"), [("dp=4", {"dp": 4}, ("ddp",)), ("tp=4", {"tp": 4}, ("tp",)),
                                                     ("cp=2", {"cp": 2}, ("cp",))])
def test_one_mesh_dimension_is_its_mode_over_every_rank(text: str, mesh: dict[str, int],
                                                         modes: tuple[str, ...]) -> None:
    got = plan(text)
    assert got.mesh == mesh
    assert tuple(name for name, _, _ in got.modes) == modes


@pytest.mark.parametrize(("text", "message"), [
    ("dp=2,tp=0", "tp must be a number of ranks >= 1 (e.g. tp=2), got '0'"),
    ("dp=2,tp", "tp must be a number of ranks >= 1 (e.g. tp=2), got no size"),
    ("dp=2,tp=two", "tp must be a number of ranks >= 1 (e.g. tp=2), got 'two'"),
    ("dp=2,dp=4", "dp is given twice"),
    ("dp=2,tp=2,grad_dtype=bf16,zero=1", "grad_dtype= is an option of mode 'ddp', which zero=1 replaces along dp"),
    ("dp=2,tp=2,ranks=4", "unknown part 'ranks=4'"),
    ("dp=2,tp=2,attn=ring", "attn=ring is an option of mode 'cp' and needs cp=N"),
    ("dp=2,,tp=2", "parallel must be MODE[=VALUE]"),
    ("ddp,bf16", "'bf16' after the mode must be key=value (e.g. 'ddp,grad_dtype=bf16')"),
    ("tp=2,grad_dtype=bf16", "grad_dtype=bf16 is an option of mode 'ddp' and needs dp=N"),
    ("dp=2,ddp", "in a mesh, mode ddp runs along dp: give dp=N instead of ddp"),
    ("dp=2,attn=ring,cp=2,grad_dtype=int8", "grad_dtype must be one of"),
    ("cp=2,attn=star", "CP: attn must be one of ring, allgather, ulysses, got 'star'"),
    ("zero=4", "ZeRO: stage must be 1, 2 or 3, got 4"),
    ("ddp,reduce=fast", "ddp: reduce must be one of backend, ordered"),
    ("dp=2,tp=2,reduce=nccl", "ddp: reduce must be one of backend, ordered"),
    ("ddp,bucket=25", "mode 'ddp' does not take the options bucket=25; it takes (bucket_cap_mb=25.0, "
                      "grad_dtype=None, reduce='backend')"),
    ("zero=2,reduce=fast", "ZeRO: reduce must be one of backend, ordered"),
])
def test_a_malformed_spec_is_refused_naming_the_part(text: str, message: str) -> None:
    assert message in refusal(text)


@pytest.mark.parametrize(("text", "modes"), [
    ("ddp,grad_dtype=bf16", (("ddp", (), {"grad_dtype": "bf16"}),)),
    ("ddp=25,grad_dtype=fp16", (("ddp", (25,), {"grad_dtype": "fp16"}),)),
    ("dp=2,tp=2,grad_dtype=bf16", (("tp", (), {}), ("ddp", (), {"grad_dtype": "bf16"}))),
    ("ddp,reduce=ordered", (("ddp", (), {"reduce": "ordered"}),)),
    ("zero=2,reduce=ordered", (("zero", (2,), {"reduce": "ordered"}),)),
    ("dp=4,reduce=ordered", (("ddp", (), {"reduce": "ordered"}),)),
    # a fractional number reaches the mode as a number (a bucket of 12.5 MB), not as the text '12.5'
    ("ddp,bucket_cap_mb=12.5", (("ddp", (), {"bucket_cap_mb": 12.5}),)),
    ("zero=1,bucket_cap_mb=0.5", (("zero", (1,), {"bucket_cap_mb": 0.5}),)),
])
def test_keyword_options_after_the_mode_or_dp_go_to_the_mode(text: str, modes: object) -> None:
    assert plan(text).modes == modes


@pytest.mark.parametrize(("text", "mesh", "modes"), [
    ("dp=2,tp=2,zero=1", {"dp": 2, "tp": 2}, (("tp", (), {}), ("zero", (1,), {}))),
    ("zero=2,cp=2,dp=2", {"dp": 2, "cp": 2}, (("cp", (), {}), ("zero", (2,), {}))),
    ("dp=2,cp=2,tp=2,zero=3,attn=ulysses", {"dp": 2, "cp": 2, "tp": 2},
     (("tp", (), {}), ("cp", (), {"attn": "ulysses"}), ("zero", (3,), {}))),
    ("dp=4,zero", {"dp": 4}, (("zero", (), {}),)),  # ZeRO's default stage
    ("dp=4,zero=1,reduce=ordered", {"dp": 4}, (("zero", (1,), {"reduce": "ordered"}),)),
])
def test_zero_named_beside_the_sizes_runs_along_dp_in_place_of_ddp(text: str, mesh: dict[str, int],
                                                                   modes: object) -> None:
    got = plan(text)
    assert got.mesh == mesh
    assert got.modes == modes


@pytest.mark.parametrize(("text", "message"), [
    ("dp=2,tp=2,zero=4", "parallel 'dp=2,tp=2,zero=4': ZeRO: stage must be 1, 2 or 3, got 4"),
    ("tp=2,zero=1", "parallel 'tp=2,zero=1': zero=1 runs along dp, which the mesh does not size; give dp=N beside "
                    "it (e.g. 'dp=2,zero=1')"),
    ("cp=2,tp=2,zero=2", "zero=2 runs along dp, which the mesh does not size"),
])
def test_zero_on_a_mesh_is_refused_in_one_line_naming_what_to_give(text: str, message: str) -> None:
    got = refusal(text)
    assert message in got and "\n" not in got


class _AnotherDpMode(ParallelMode):
    """A second mode that a mesh runs along dp when named, as ZeRO is."""

    dim = "dp"
    on_mesh_by_name = True


def test_two_modes_named_for_one_dimension_are_refused_naming_both() -> None:
    with plugin_registered(_ModePlugin("fsdp", _AnotherDpMode), "another-dp-mode"):
        message = refusal("dp=2,tp=2,zero=1,fsdp")
    assert message == ("parallel 'dp=2,tp=2,zero=1,fsdp': zero=1 and fsdp both run along dp; a dimension takes one "
                       "mode, give one of them")


def test_a_named_mode_composes_with_compile_only_where_it_declares_it(monkeypatch: pytest.MonkeyPatch) -> None:
    plan("dp=2,tp=2,zero=2", compile=True, seq_len=64)
    from blutrain.dist import parallel_modes

    monkeypatch.setattr(parallel_modes().get("zero"), "compiles", False)
    assert "mode 'zero' has not declared how it composes with the compiler" in refusal("dp=2,tp=2,zero=2",
                                                                                      compile=True, seq_len=64)


def test_cp_needs_two_chunks_of_every_sequence_per_rank() -> None:
    assert "seq_len must be a multiple of 8 under parallel 'cp=4' (mode 'cp' over cp=4" in refusal("cp=4", seq_len=20)
    plan("cp=4", seq_len=24)


@pytest.mark.parametrize(("text", "modes"), [
    ("tp=2,async=4", (("tp", (), {"async_chunks": 4}),)),
    ("tp=2,async=0", (("tp", (), {"async_chunks": 0}),)),  # 0 row blocks: synchronous, as TP's default
    ("dp=2,tp=2,async=1", (("tp", (), {"async_chunks": 1}), ("ddp", (), {}))),
])
def test_async_passes_its_row_blocks_to_tp(text: str, modes: object) -> None:
    assert plan(text).modes == modes


@pytest.mark.parametrize(("text", "message"), [
    ("tp=2,async=two", "TP: async_chunks must be an int >= 1 (the row blocks whose all-reduce overlaps the next "
                       "block's GEMM), got 'two'"),
    ("dp=2,cp=2,async=2", "async=2 is an option of mode 'tp' and needs tp=N"),
])
def test_a_malformed_async_is_refused_naming_it(text: str, message: str) -> None:
    assert message in refusal(text)


def test_tp_checkpoints_may_be_written_asynchronously() -> None:
    plan("dp=2,tp=2", async_checkpoint=True)


def test_a_mesh_of_other_than_the_ranks_of_the_run_is_refused_before_any_group_is_made(tmp_path: object) -> None:
    cfg = TrainConfig(parallel="dp=2,tp=2", out=str(tmp_path), device="cpu")
    with pytest.raises(ConfigError, match=r"lays out 4 ranks \(dp 2 × tp 2\), but this run has 1 rank\(s\)"):
        Trainer(cfg)


@pytest.mark.parametrize("text", ["ddp", "zero=1", "zero=3", "dp=2", "tp=2", "tp=2,async=4", "dp=2,tp=2", "cp=2",
                                  "dp=2,cp=2,attn=ulysses", "dp=2,cp=2,attn=allgather"])
def test_every_built_in_mode_composes_with_compile(text: str) -> None:
    plan(text, compile=True, seq_len=64)


@pytest.mark.parametrize(("text", "mode"), [("tp=2", "tp"), ("dp=2,cp=2", "cp"), ("dp=2,tp=2", "tp")])
def test_compile_with_a_mode_that_did_not_declare_it_is_refused_naming_mode_and_reason(
        text: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from blutrain.dist import parallel_modes

    monkeypatch.setattr(parallel_modes().get(mode), "compiles", False)
    message = refusal(text, compile=True, seq_len=64)
    assert f"mode {mode!r} has not declared how it composes with the compiler" in message
    assert "does not set compiles = True" in message and "blutrain.dist.traceable" in message


def test_a_dimension_whose_only_mode_runs_when_named_needs_it_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from blutrain.dist import parallel_modes

    monkeypatch.setattr(parallel_modes().get("ddp"), "on_mesh", False)  # as if ddp were blocked
    assert refusal("dp=2,tp=2") == ("parallel 'dp=2,tp=2': no installed mode runs along dp unless named; give one "
                                    "beside dp=2: zero[=VALUE]")
    assert plan("dp=2,tp=2,zero=1").modes == (("tp", (), {}), ("zero", (1,), {}))
