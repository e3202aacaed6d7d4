"""The calibration pass as Ray tasks (``onnxq quantize --ray [ADDRESS]``, ``onnxq[ray]``).

The model goes to the cluster once (the object store); each of the N tasks (``--workers N``,
by default the cluster's CPUs) opens its own share of the data where it runs, folds it into
:class:`~onnxq.calibrate.statistics.Statistics`, and only the statistics come back; the driver
merges them in task order. No tensor crosses the network.

The data must be something every task can open itself (:class:`ShardedData`):

* a folder of ``.npy``/``.npz`` samples, or of images with ``--preprocess``: task ``s`` reads
  the files of the blocks ``s``, ``s + N``, ... (a block: see ``Statistics.block``), so the
  model is byte-identical to one process's with the built-in methods;
* an ``.npz`` file: every task loads it and keeps its blocks of batches (same result);
* ``module:function`` whose parameters ``shard`` and ``shards`` default to 0 and 1: task ``s``
  calls ``function(s, N)``; its ``j``-th batch counts as batch ``j·N + s``. The ranges of every
  built-in method are the ones one process gets from ``function()`` (they do not depend on the
  order of the batches); optimized rounding's Hessians take their rows per batch number, so they
  match when ``function()`` yields the shards' batches interleaved in that order.

Paths must name the same files on every node (a shared filesystem on a real cluster; any path
on a local one). Without an address a local cluster of this machine's cores is started for
the call and stopped after it; with one (``auto``, ``HOST:PORT``, ``ray://HOST:PORT``) onnxq
connects to the user's cluster, whose nodes need onnxq installed.
"""

from __future__ import annotations

import inspect
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from onnxq.calibrate.dataset import Feed, FolderDataset, InputSpec, feed_samples
from onnxq.calibrate.images import ImageFolderDataset
from onnxq.calibrate.sources import as_dataset
from onnxq.calibrate.statistics import Statistics, block_size
from onnxq.calibrate.streaming import available_cores
from onnxq.core.errors import CalibrationError, ConfigError, OnnxqError
from onnxq.io.graph import TWO_GIB, proto_size, serialize
from onnxq.io.loader import is_reference, load_object

#: what a local cluster is started with (besides its CPUs)
LOCAL = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}


@dataclass(frozen=True)
class ShardedData:
    """Calibration data each task opens itself: a path or ``module:function``."""

    ref: str
    batch_size: int | None = None
    limit: int | None = None
    preprocess: str | None = None

    @property
    def function(self) -> bool:
        """Whether ``ref`` names a function (else a folder or .npz path)."""
        return is_reference(self.ref)

    @classmethod
    def of(cls, data: Any, batch_size: int | None, limit: int | None, preprocess: str | None):
        """``data`` as tasks can open it, or a clear error for data only this process holds."""
        if isinstance(data, str | os.PathLike) and not is_reference(str(data)):
            path = Path(data).resolve()
            if not path.exists():
                raise ConfigError(f"--ray: calibration data '{data}' does not exist")
            return cls(str(path), batch_size, limit, preprocess)
        if isinstance(data, str):
            params = inspect.signature(load_object(data, "--data")).parameters
            if not {"shard", "shards"} <= set(params):
                raise ConfigError(
                    f"--ray: --data {data!r} must take the parameters shard and shards "
                    "(defaulting to 0 and 1): each task calls it with its own index"
                )
            return cls(data, batch_size, None, preprocess)
        raise ConfigError(
            "--ray needs calibration data every task can open itself: a folder, an .npz "
            "path or 'module:function' taking (shard, shards); this data lives in this "
            "process only (use --workers for local processes)"
        )


def shard_feeds(
    data: ShardedData, inputs: list[InputSpec], shard: int, shards: int, block: int
) -> Iterator[tuple[int, Feed]]:
    """(batch number, feed) of shard ``shard`` of ``shards``, read where the task runs."""
    if data.function:
        produced = load_object(data.ref, "--data")(shard=shard, shards=shards)
        ds = as_dataset(produced, inputs, data.batch_size, None, None)
        for j, feed in enumerate(ds.batches()):
            yield j * shards + shard, feed
        return
    ds = as_dataset(data.ref, inputs, data.batch_size, data.limit, data.preprocess)
    mine = lambda i: (i // block) % shards == shard  # noqa: E731
    if isinstance(ds, FolderDataset | ImageFolderDataset):  # one batch per file: read its own
        keep = [i for i in range(ds.num_batches()) if mine(i)]
        ds.files, ds.limit = [ds.files[i] for i in keep], None
        yield from zip(keep, ds.batches(), strict=False)
        return
    for i, feed in enumerate(ds.batches()):
        if mine(i):
            yield i, feed


def first_block(data: ShardedData, inputs: list[InputSpec]) -> int:
    """The block size one process would use (from the first batch; 1 for shard functions)."""
    if data.function:
        return 1
    ds = as_dataset(data.ref, inputs, data.batch_size, data.limit, data.preprocess)
    first = next(iter(ds.batches()), None)
    return block_size(feed_samples(first)) if first is not None else 1


def observe_on_ray(
    model: onnx.ModelProto,
    names: list[str],
    template: Statistics,
    data: ShardedData,
    inputs: list[InputSpec],
    address: str | None,
    shards: int | None,
    threads: int | None,
) -> Iterator[Statistics]:
    """Each task's statistics, in task order (see the module doc)."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--ray needs Ray: pip install 'onnxq[ray]' (or pip install ray)"
        ) from None
    if proto_size(model) >= TWO_GIB:
        raise ConfigError(
            "--ray sends the model through Ray's object store as one message, which models "
            "over 2 GB cannot be; calibrate them with --workers"
        )
    started = not ray.is_initialized()
    if started:
        _connect(ray, address)
    try:
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        shards = shards or cpus
        threads = threads or max(1, cpus // shards)
        template.block = first_block(data, inputs)
        blank = pickle.dumps(template)
        model_ref = ray.put(serialize(model))
        task = ray.remote(num_cpus=min(threads, cpus), max_retries=0)(_shard_task)
        refs = [
            task.remote(model_ref, names, blank, data, inputs, s, shards, template.block, threads)
            for s in range(shards)
        ]
        for s, ref in enumerate(refs):
            yield _result(ray, ref, s)
    finally:
        if started:
            ray.shutdown()


def _connect(ray: Any, address: str | None) -> None:

    if address:
        _reachable(address)
    try:
        if address:
            ray.init(address=address, **LOCAL)
        else:
            ray.init(num_cpus=available_cores(), **LOCAL)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"the cluster at {address!r}" if address else "a local cluster"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"--ray: cannot start or reach {where} ({first}); start one with "
            "'ray start --head', or give no address for a local one"
        ) from None


def _reachable(address: str, timeout: float = 5.0) -> None:
    """Fail fast on a HOST:PORT nothing listens at (Ray itself retries for minutes)."""
    import socket

    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return  # "auto" or another form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(
            f"--ray {address}: nothing answers there ({exc.strerror or exc}); start the "
            "cluster with 'ray start --head', or give no address for a local one"
        ) from None


def _result(ray: Any, ref: Any, shard: int) -> Statistics:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None) or exc
        if isinstance(cause, OnnxqError):
            raise CalibrationError(f"calibration task {shard}: {cause}") from None
        text = str(cause).strip().splitlines()
        raise CalibrationError(
            f"calibration task {shard} failed: {type(cause).__name__}: {text[-1] if text else ''}"
        ) from None
    except ray.exceptions.RayError as exc:
        raise CalibrationError(f"calibration task {shard} was lost: {exc}") from None


def _shard_task(
    model_bytes: bytes,
    names: list[str],
    blank: bytes,
    data: ShardedData,
    inputs: list[InputSpec],
    shard: int,
    shards: int,
    block: int,
    threads: int,
) -> Statistics:  # pragma: no cover - runs in Ray's worker processes (tested through them)
    """One task: its share of the data folded into the blank statistics."""
    from onnxq.calibrate.shards import fold_numbered

    model = onnx.load_from_string(model_bytes)
    feeds = shard_feeds(data, inputs, shard, shards, block)
    return fold_numbered(model, names, blank, feeds, threads)
