"""Dispatchers: what the reput loop hands each decoded batch to.

A dispatcher is anything with `dispatch(batch)`, `flush()` and `close()`. The built-ins write the
broker's ConsumeQueue and IndexFile; a third party plugs in by naming `package.module:Class` in the
config's `dispatchers:` list. The class is constructed as `Class(options=..., store=..., output_dir=...)`
with the entry's `options` mapping, the `StoreConfig` and the output directory; naming a class in the
config runs its code, so the config file is trusted input.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from daemon.config import Config, ConfigError, DispatcherSpec, StoreConfig
from daemon.logs import get_logger
from indexcore.consumequeue import ConsumeQueueStore, PutStats
from indexcore.dispatch import DispatchBatch
from indexcore.indexservice import IndexService, IndexStats


@runtime_checkable
class Dispatcher(Protocol):
    """Takes every batch in CommitLog order. `dispatch` may raise; the loop then stops at that batch."""

    name: str

    def dispatch(self, batch: DispatchBatch) -> None: ...

    def flush(self) -> None:
        """Make everything dispatched so far durable; the checkpoint is written only after this returns."""

    def close(self) -> None: ...


class ConsumeQueueDispatcher:
    """`CommitLogDispatcherBuildConsumeQueue`: one unit per NOT_TYPE/COMMIT_TYPE record."""

    name = "consumequeue"

    def __init__(self, store: StoreConfig, output_dir: str):
        self.queues = ConsumeQueueStore(output_dir, store.mapped_file_size_consume_queue)
        self.queues.load()
        self.stats = PutStats()
        self._log = get_logger(dispatcher=self.name)

    def dispatch(self, batch: DispatchBatch) -> None:
        stats = self.queues.dispatch(batch)
        if stats.out_of_order:
            self._log.warning("logic_queue_order_maybe_wrong", units=stats.out_of_order,
                              batch_start=batch.start_offset)
        self.stats.add(stats)

    def files(self) -> int:
        return sum(cq.file_count for cq in self.queues)

    def flush(self) -> None:
        self.queues.flush()

    def close(self) -> None:
        self.queues.close()


class IndexDispatcher:
    """`CommitLogDispatcherBuildIndex`: UNIQ_KEY and KEYS of every record but ROLLBACK."""

    name = "index"

    def __init__(self, store: StoreConfig, output_dir: str):
        self.service = IndexService(output_dir, store.max_hash_slot_num, store.max_index_num, store.max_msgs_num_batch)
        self.service.load()
        self.stats = IndexStats()
        self._log = get_logger(dispatcher=self.name)

    def dispatch(self, batch: DispatchBatch) -> None:
        stats = self.service.build_index(batch)
        if stats.files_created:
            self._log.info("index_file_rolled", files=self.service.names[-stats.files_created:])
        self.stats.keys_put += stats.keys_put
        self.stats.files_created += stats.files_created

    def files(self) -> int:
        return len(self.service.names)

    def flush(self) -> None:
        self.service.flush()

    def close(self) -> None:
        self.service.close()


def load_plugin(spec: DispatcherSpec, index: int) -> type:
    module_name, _, class_name = spec.name.partition(":")
    key = f"dispatchers[{index}].name"
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(key, f"cannot import dispatcher module {module_name!r}: {e}") from None
    target: Any = module
    for part in class_name.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(key, f"module {module_name!r} has no {class_name!r}")
    return target


def build_dispatchers(config: Config, output_dir: str, options: Mapping[str, Any] | None = None) -> list[Dispatcher]:
    """The configured dispatchers, in order; `index` is left out when messageIndexEnable is false."""
    out: list[Dispatcher] = []
    for i, spec in enumerate(config.dispatchers):
        if spec.name == ConsumeQueueDispatcher.name:
            out.append(ConsumeQueueDispatcher(config.store, output_dir))
        elif spec.name == IndexDispatcher.name:
            if config.store.message_index_enable:
                out.append(IndexDispatcher(config.store, output_dir))
        else:
            cls = load_plugin(spec, i)
            instance = cls(options=spec.options, store=config.store, output_dir=output_dir)
            if not isinstance(instance, Dispatcher):
                raise ConfigError(f"dispatchers[{i}].name",
                                  f"{spec.name} lacks dispatch(batch), flush() or close()")
            out.append(instance)
    return out
