"""Save and resume training state: atomic checkpoints, safe loading, rotation, best checkpoint.

A checkpoint is a directory `output_dir/checkpoint-<step>/` holding

    model.safetensors (or HF shards + index)   weights (plus config.json for Hugging Face models)
    adapter_model.safetensors + adapter_config.json   instead, for a peft (LoRA) model: the adapters and
                                                the trained head only, in peft's format
    optimizer.pt, scheduler.pt, scaler.pt       state dicts, each only when that object was given
    rng_state.pt                                python, numpy, torch CPU (and CUDA) RNG states
    trainer_state.json                          the Loop's counters, sampler position, best metric
    metrics.json                                the evaluation scores at this step, when given
    COMPLETE                                    written last: the directory is whole

It is written into `output_dir/.tmp-checkpoint-<step>-<pid>/`, fsynced, and renamed into place, so
a crash leaves either the previous checkpoints or the new one, never a half-written
`checkpoint-<step>`. Everything is read back with `torch.load(weights_only=True)`, which refuses
to execute code hidden in a pickle. See docs/checkpoints.md.

Modules:
    layout    the file names, `checkpoint_name`, the COMPLETE marker, `CheckpointError`, `unwrap_model`
    files     `write_json_atomic`; the fsync and the rename that publish a finished directory
    rng       `capture_rng_state`, `restore_rng_state`: the global RNGs, loadable with weights_only
    best      `BestTracker`, `is_better`, `default_mode`: the best value of one metric and its checkpoint
    save      `save_checkpoint`: temp dir, fsync, COMPLETE, rename (a full disk named as such);
              `published_directory`: any other directory of a run (final/) written the same way
    fit       `check_weights_fit`, `checkpoint_weight_shapes`: whether the weights fit a model (headers only)
    load      `load_checkpoint`, `load_model_weights`: read back strictly, nothing that can run code;
              `check_trainer_state`: the counters a reader needs, each of its type
    find      `list_checkpoints`, `latest_checkpoint`, `resolve_resume_checkpoint`
    rotation  `rotate_checkpoints`, `remove_stale_temporary_dirs`: the newest N plus the best kept
"""

from looptrain.checkpoint.best import BestTracker, default_mode, is_better
from looptrain.checkpoint.files import write_json_atomic
from looptrain.checkpoint.find import latest_checkpoint, list_checkpoints, resolve_resume_checkpoint
from looptrain.checkpoint.fit import check_weights_fit, checkpoint_weight_shapes
from looptrain.checkpoint.layout import CheckpointError, checkpoint_name, unwrap_model
from looptrain.checkpoint.load import check_trainer_state, load_checkpoint, load_model_weights
from looptrain.checkpoint.rng import capture_rng_state, restore_rng_state
from looptrain.checkpoint.rotation import remove_stale_temporary_dirs, rotate_checkpoints
from looptrain.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "BestTracker",
    "is_better",
    "save_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "check_trainer_state",
    "check_weights_fit",
    "checkpoint_weight_shapes",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_resume_checkpoint",
    "rotate_checkpoints",
    "remove_stale_temporary_dirs",
    "capture_rng_state",
    "restore_rng_state",
    "checkpoint_name",
    "default_mode",
    "unwrap_model",
    "write_json_atomic",
]
