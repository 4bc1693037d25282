"""Training checkpoints with orbax: the whole `TrainState`, the config, and host-side extras.

Layout: `<directory>/<step>/` per checkpoint (orbax `CheckpointManager`), each holding
  * `state`: every array leaf of the TrainState (master params, optimizer state, step, loss-scale
    state, recurrent state, gradient accumulator), stored under its key path
    (`.params['layers'][0]['mixer']['A_log'].value`). A state class may name the tree to store with a
    `checkpoint_tree()` method and take it back with `from_checkpoint_tree(tree)`: the TrainState
    stores the nnx.State view of its plain-dict params and optimizer state, so the key paths are
    those of the nnx layout, the same before and after the TrainState kept plain dicts;
  * `meta`: JSON with the format version, the config (`jmamba.configs`), the key paths with their
    shapes/dtypes, and the caller's `extras` (RNG key, data position, anything JSON-able).

Atomicity: orbax writes a checkpoint into a temporary folder and renames it into place only when it is
complete, so a save killed half-way leaves the previous checkpoints loadable (tested by killing a
process mid-save). Saving is synchronous (returns once the checkpoint is final).

Errors: a checkpoint that cannot be read (missing, incomplete or corrupt files) raises
`CheckpointError`, one that does not fit `like` or `config` raises `CheckpointMismatchError`; both
are `ValueError`s and name the step and the file or field.

Restoring checks before anything is read into the target: the config (when the caller passes one) and
every key path, shape and dtype of `like`; a mismatch raises naming the field or path. Checkpoints of
an older layout restore too: a config field that is no longer part of the config (the Mamba-3
`chunk_size`, now a tuning knob) is ignored, and a state field added since (e.g. `TrainState.updates`)
is filled from the leaf its class names in `checkpoint_upgrades` (or with zeros).

This module works on any flax dataclass pytree with a `step`; it does not import the training layer.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jmamba.configs import config_from_dict, config_to_dict, normalize_config_dict

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: missing, incomplete or corrupt files (names the step and file)."""


class CheckpointMismatchError(ValueError):
    """A readable checkpoint that does not fit: another config, architecture, optimizer or shape."""


def _check_state(state, name):
    if not (hasattr(state, "step") and hasattr(state, "replace") and jax.tree.leaves(state)):
        raise TypeError(f"{name} must be a jmamba.TrainState, got {type(state).__name__}")


def _stored_tree(state):
    """The tree a checkpoint stores for `state`: `state.checkpoint_tree()` when its class defines one
    (the TrainState stores its nnx.State view, keeping the key paths of that layout), else `state`."""
    hook = getattr(state, "checkpoint_tree", None)
    return state if hook is None else hook()


def _flatten(state) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(state)}


def _manager(directory, keep=None, read_only=False):
    # Readers neither create the folder nor clean up a concurrent writer's temporary folders.
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                           enable_async_checkpointing=False,
                                           cleanup_tmp_directories=not read_only)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_names=("state", "meta"))


def _to_jsonable(x):
    if isinstance(x, (jax.Array, np.ndarray)):
        a = np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        return {"__array__": a.tolist(), "dtype": str(a.dtype)}
    if isinstance(x, dict):
        return {str(k): _to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_jsonable(v) for v in x]
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    return x


def _from_jsonable(x):
    if isinstance(x, dict):
        if "__array__" in x:
            return np.asarray(x["__array__"], dtype=x["dtype"])
        return {k: _from_jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_jsonable(v) for v in x]
    return x


def save_checkpoint(directory, state, *, config=None, extras: Optional[dict] = None,
                    keep: Optional[int] = 3) -> str:
    """Saves `state` as checkpoint number `state.step` under `directory`.

    Args:
      directory: folder of checkpoints (created if missing).
      state: the TrainState (no split-API forward pending).
      config: the model config (backbone config or MambaLMConfig), stored for restore-time checks.
      extras: small host-side values to keep with it (e.g. {"rng": key, "data_position": positions}):
        numbers, strings, lists, dicts, numpy/jax arrays (stored as JSON, so keep them small).
      keep: how many checkpoints to keep (older ones are deleted); None keeps all.

    Returns:
      the path of the written checkpoint.
    """
    _check_state(state, "state")
    if getattr(state, "pending_forward", None) is not None:
        raise RuntimeError("cannot checkpoint while a split-API forward is pending: run backward_step first")
    if getattr(state, "accumulating", False):
        raise RuntimeError("cannot checkpoint inside an open gradient-accumulation window")
    flat = _flatten(_stored_tree(state))
    meta = {
        "format_version": FORMAT_VERSION,
        "config": None if config is None else config_to_dict(config),
        "leaves": {k: [list(np.shape(v)), str(jnp.result_type(v))] for k, v in flat.items()},
        "extras": _to_jsonable(extras or {}),
    }
    json.dumps(meta)   # fail before writing anything if extras are not JSON-able
    step = int(state.step)
    mngr = _manager(directory, keep)
    try:
        if step in mngr.all_steps():
            raise FileExistsError(f"a checkpoint for step {step} already exists in {directory}")
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta)))
        mngr.wait_until_finished()
    finally:
        mngr.close()
    return os.path.join(os.path.abspath(directory), str(step))


def latest_step(directory) -> Optional[int]:
    """The newest complete checkpoint's step in `directory`, or None."""
    if not os.path.isdir(directory):
        return None
    mngr = _manager(directory, read_only=True)
    try:
        return mngr.latest_step()
    finally:
        mngr.close()


def _step_dir(mngr, step):
    return os.path.join(str(mngr.directory), str(step))


def _read_meta(mngr, step):
    where = os.path.join(_step_dir(mngr, step), "meta", "metadata")
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:   # noqa: BLE001  (orbax raises many kinds for a damaged folder)
        raise CheckpointError(f"checkpoint step {step} is unreadable: its metadata {where} could not be read "
                              f"({type(e).__name__}: {e})") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("leaves"), dict):
        raise CheckpointError(f"checkpoint step {step} is incomplete: {where} has no leaf table")
    return meta


def _resolve_step(mngr, directory, step):
    steps = mngr.all_steps()
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint in {directory}")
    if step is None:
        return max(steps)
    if step not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {directory} (have {sorted(steps)})")
    return step


@contextlib.contextmanager
def _open_checkpoint(directory, step):
    """Yields (manager, resolved step, metadata) of a checkpoint (the newest when step is None)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no checkpoint directory {directory}")
    mngr = _manager(directory, read_only=True)
    try:
        step = _resolve_step(mngr, directory, step)
        yield mngr, step, _read_meta(mngr, step)
    finally:
        mngr.close()


def checkpoint_info(directory, step: Optional[int] = None) -> dict:
    """{"step", "config" (object or None), "extras"} of a checkpoint (the newest by default)."""
    with _open_checkpoint(directory, step) as (_, step, meta):
        pass
    try:
        cfg = None if meta.get("config") is None else config_from_dict(meta["config"])   # old fields dropped
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"checkpoint step {step} in {directory} holds an unreadable config: {e}") from e
    return {"step": step, "config": cfg, "extras": _from_jsonable(meta.get("extras", {}))}


def restore_checkpoint(directory, like, *, step: Optional[int] = None, config=None):
    """Restores a checkpoint into the structure of `like`.

    Args:
      directory: folder given to `save_checkpoint`.
      like: a TrainState with the target structure (e.g. `TrainState.create(...)` for the same model,
        optimizer and batch size); its arrays are not modified.
      step: which checkpoint (default: the newest complete one).
      config: if given, must equal the saved config (else ValueError naming the differing fields).

    Returns:
      the restored TrainState (same static fields as `like`).
    """
    _check_state(like, "like")
    with _open_checkpoint(directory, step) as (mngr, step, meta):
        if meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint step {step} in {directory} has format "
                                  f"{meta.get('format_version')!r}, this jmamba reads {FORMAT_VERSION}")
        _check_config(meta.get("config"), config)
        like_tree = _stored_tree(like)
        flat_like = _flatten(like_tree)
        upgrades = {k: src for k, src in getattr(type(like), "checkpoint_upgrades", {}).items()
                    if k in flat_like and k not in meta["leaves"] and (src is None or src in meta["leaves"])}
        _check_leaves(meta["leaves"], {k: v for k, v in flat_like.items() if k not in upgrades})
        # restore straight into `like`'s placement (a sharded `like` gives a sharded state)
        target = {k: jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v), sharding=getattr(v, "sharding", None))
                  for k, v in flat_like.items() if k not in upgrades}
        try:
            flat = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
        except Exception as e:   # noqa: BLE001
            raise CheckpointError(f"checkpoint step {step} is unreadable: the arrays in "
                                  f"{os.path.join(_step_dir(mngr, step), 'state')} could not be restored "
                                  f"({type(e).__name__}: {str(e)[:300]})") from e
        missing = [k for k in target if k not in flat]
        if missing:
            raise CheckpointError(f"checkpoint step {step} is incomplete: no arrays for {missing[:5]} in "
                                  f"{os.path.join(_step_dir(mngr, step), 'state')}")
    for k, src in upgrades.items():   # a field the checkpoint predates: copied from its source leaf, or zeros
        kind = jnp.result_type(flat_like[k])
        flat[k] = jnp.zeros(np.shape(flat_like[k]), kind) if src is None else jnp.asarray(flat[src]).astype(kind)
    leaves = [jnp.asarray(flat[k]) for k in flat_like]
    restored = jax.tree.unflatten(jax.tree.structure(like_tree), leaves)
    return like.from_checkpoint_tree(restored) if like_tree is not like else restored


def _check_config(saved, given):
    if given is None:
        return
    want = config_to_dict(given)
    if saved is None:
        raise CheckpointMismatchError("the checkpoint has no config to compare with `config`")
    saved = normalize_config_dict(saved)
    if saved != want:
        diffs = _dict_diff(saved, want)
        raise CheckpointMismatchError(f"checkpoint config differs from `config`: {diffs}")


def _dict_diff(a, b, prefix=""):
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, "<missing>"), b.get(k, "<missing>")
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _dict_diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: saved {va!r} vs given {vb!r}")
    return out


def _check_leaves(saved: dict, flat_like: dict):
    missing = [k for k in flat_like if k not in saved]
    extra = [k for k in saved if k not in flat_like]
    if missing or extra:
        raise CheckpointMismatchError(f"checkpoint structure differs from `like` (different architecture, config or "
                         f"optimizer?): missing in checkpoint {missing[:5]}, unexpected {extra[:5]}")
    for k, v in flat_like.items():
        shape, dtype = saved[k]
        if tuple(shape) != tuple(np.shape(v)) or dtype != str(jnp.result_type(v)):
            raise CheckpointMismatchError(f"checkpoint leaf {k} has shape {tuple(shape)} {dtype}, `like` expects "
                             f"{tuple(np.shape(v))} {jnp.result_type(v)}")
