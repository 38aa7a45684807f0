"""blutrain.dist: distributed execution — process groups, the device mesh, the rendezvous store, the
``blutrain run`` launcher, and the hook specifications that comm-backend and parallelism-mode plugins fill."""

from blutrain.dist.coalesced import all_reduce_coalesced
from blutrain.dist.env import RUN_ID_ENV, DistEnv, detect
from blutrain.dist.exchange import WorkList, sendrecv
from blutrain.dist.errors import (
    CollectiveTimeoutError,
    DistArgumentError,
    DistEnvironmentError,
    DistError,
    LaunchError,
    StoreError,
    StoreTimeoutError,
)
from blutrain.dist.grad_buckets import (
    DEFAULT_BUCKET_CAP_MB,
    GradBucket,
    GradientAverager,
    broadcast_from_rank0,
    bucket_parameters,
)
from blutrain.dist.group import (
    before_destroy,
    default_comm_backend,
    destroy_process_group,
    get_process_group,
    get_rank,
    get_store,
    get_world_size,
    init_process_group,
    is_initialized,
)
from blutrain.dist.mesh import DeviceMesh
from blutrain.dist.ordered_reduce import (
    GRAD_REDUCTIONS,
    OrderedReduction,
    check_reduction,
    ordered_reduce_scatter,
    padded_numel,
    rank_ordered_sum,
)
from blutrain.dist.parallel import ParallelMode
from blutrain.dist.placement import Placement, take_range, whole_placements
from blutrain.dist.process_group import REDUCE_OPS, CompletedWork, ProcessGroup, ReduceOp, Work
from blutrain.dist.registry import CommBackendRegistry, ParallelModeRegistry, comm_backends, parallel_modes
from blutrain.dist.sharded import Range, StateShard, Window, merge_shards
from blutrain.dist.store import Store, StoreServer, TCPStore
from blutrain.dist.traceable import TraceableGroup, traceable

__all__ = ["DEFAULT_BUCKET_CAP_MB", "GRAD_REDUCTIONS", "OrderedReduction", "check_reduction", "ordered_reduce_scatter",
           "padded_numel", "rank_ordered_sum", "REDUCE_OPS", "RUN_ID_ENV", "CollectiveTimeoutError", "CommBackendRegistry", "CompletedWork", "DeviceMesh", "DistArgumentError",
           "DistEnv", "DistEnvironmentError", "DistError", "GradBucket", "GradientAverager", "LaunchError", "ParallelMode", "ParallelModeRegistry", "Placement", "Range",
           "ProcessGroup", "ReduceOp", "Store", "StoreError", "StoreServer", "StateShard", "StoreTimeoutError", "TCPStore", "TraceableGroup", "Window",
           "Work", "WorkList", "all_reduce_coalesced", "before_destroy", "default_comm_backend", "broadcast_from_rank0", "bucket_parameters", "comm_backends", "destroy_process_group", "detect", "get_process_group", "get_rank", "get_store",
           "get_world_size", "init_process_group", "is_initialized", "merge_shards", "parallel_modes", "sendrecv", "take_range", "traceable", "whole_placements"]
