"""Checkpoints: everything a run needs to continue exactly, written so that no crash can lose one.

A run's state is a set of named *stateful* parts, each with ``state_dict()`` / ``load_state_dict()``
(the torchtitan / ``torch.distributed.checkpoint.stateful.Stateful`` protocol): the model, the
optimizer (AdamW or Muon + AdamW), the GradScaler, the data loader's position, the RNG states and
the trainer's counters. The package, one concept a module:

- :mod:`~gptspeed.checkpoint.paths` -- the names in a run folder;
- :mod:`~gptspeed.checkpoint.seals` -- what vouches for a checkpoint (bytes, sha256, step, run id,
  configuration) and which checkpoint is the newest valid one of a run;
- :mod:`~gptspeed.checkpoint.formats` -- ``.pt`` (one process, DDP) and ``.dcp`` (FSDP2) as two small
  classes, each written atomically and sealed before it stands under its name;
- :mod:`~gptspeed.checkpoint.dcp_reader` -- sharded checkpoints read without running pickled code;
- :mod:`~gptspeed.checkpoint.parts` -- the model, optimizer and RNG parts;
- :mod:`~gptspeed.checkpoint.manager` -- the :class:`Checkpointer` (parts by name, when to save, load);
- :mod:`~gptspeed.checkpoint.folder` -- the run folder: its lock, gptspeed's own or refused;
- :mod:`~gptspeed.checkpoint.consolidate` -- a sharded checkpoint made one file.

Which checkpoint a ``--resume`` continues, and whether it may, is decided before the checkpointer
exists: :mod:`gptspeed.resume`. Modules here import torch only inside the functions that need it, so
reading seals (and the configuration a resume continues with) costs no torch import.
"""

from gptspeed.checkpoint.consolidate import consolidate, split_optimizer_state
from gptspeed.checkpoint.folder import (
    RunFolder,
    check_free_space,
    estimate_checkpoint_bytes,
    foreign_entries,
    refuse_foreign_folder,
    run_lock,
)
from gptspeed.checkpoint.formats import (
    DcpFormat,
    PtFormat,
    check_room,
    load_checkpoint,
    load_latest,
    load_latest_run,
    prune_checkpoints,
    save_checkpoint,
    seal_sharded,
    write_checkpoint_file,
    write_failure,
)
from gptspeed.checkpoint.manager import Checkpointer
from gptspeed.checkpoint.parts import ModelState, OptimizerState, RNGState, Stateful, load_part, optimizers_of
from gptspeed.checkpoint.paths import (
    CKPT_RE,
    FORMAT,
    FORMAT_VERSION,
    LOCK_NAME,
    OWN_NAMES,
    SHARDED_META,
    STALE_NAMES,
    checkpoint_path,
    is_sharded,
    list_checkpoints,
    seal_path,
    step_of,
)
from gptspeed.checkpoint.seals import (
    check_checkpoint,
    checkpoint_config,
    data_changed,
    folder_run_id,
    latest_valid_checkpoint,
    newest_run_config,
    not_of_run,
    read_seal,
    refuse_checkpoints,
    seal_info,
    started_run,
)

__all__ = [
    "CKPT_RE",
    "FORMAT",
    "FORMAT_VERSION",
    "LOCK_NAME",
    "OWN_NAMES",
    "SHARDED_META",
    "STALE_NAMES",
    "checkpoint_path",
    "is_sharded",
    "list_checkpoints",
    "seal_path",
    "step_of",
    "check_checkpoint",
    "checkpoint_config",
    "data_changed",
    "folder_run_id",
    "latest_valid_checkpoint",
    "newest_run_config",
    "not_of_run",
    "read_seal",
    "refuse_checkpoints",
    "seal_info",
    "started_run",
    "DcpFormat",
    "PtFormat",
    "check_room",
    "load_checkpoint",
    "load_latest",
    "load_latest_run",
    "prune_checkpoints",
    "save_checkpoint",
    "seal_sharded",
    "write_checkpoint_file",
    "write_failure",
    "ModelState",
    "OptimizerState",
    "RNGState",
    "Stateful",
    "load_part",
    "optimizers_of",
    "Checkpointer",
    "RunFolder",
    "check_free_space",
    "estimate_checkpoint_bytes",
    "foreign_entries",
    "refuse_foreign_folder",
    "run_lock",
    "consolidate",
    "split_optimizer_state",
]
