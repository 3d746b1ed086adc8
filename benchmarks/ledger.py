"""The write ledger's cost: the same flow with and without ``modattrs.ledger.watch()``, alternately, in one process.

Run with ``python benchmarks/ledger.py`` (needs ``transformers``; ``--quick`` for one run of each on smaller models).
Prints, as ratios against the flow without the ledger (target: at most 1.2x):

* a Llama of about 300M parameters built by ``from_config`` on the meta device, ``to_empty``, and initialized by
  transformers' own ``init_weights()``;
* ``from_pretrained`` of Llamas saved in a temporary directory (safetensors): the same 300M one, and one of about
  80M, where the ledger's cost per operation (some tens of microseconds) weighs most against the copies;

and, beside each load, what a dispatch mode that only runs each operation costs it: the floor of any ledger that
watches operations from Python (torch's own price of entering Python for each). Then the memory the ledger keeps
for the first: intervals per storage, against the model's bytes (target: 1%). The
first watch of a process costs some milliseconds more, once (printed): it looks at every imported module for
loaders bound by name.
Times are the process's CPU time (``time.process_time``: transformers loads in worker threads), on one torch thread,
in rounds that run the flow each way back to back: 3 rounds for the 300M initialization (seconds each), 25 for each
``from_pretrained`` (about 0.15 s each; on a shared machine runs of the same flow vary by a third). Printed: the
median time each way, and the median of the rounds' ratios, which a machine that slows down or speeds up between
rounds does not move.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

from modattrs._compiled import install_dispatch_entry
from modattrs._torch_private import TorchDispatchMode
from modattrs.ledger import watch


def llama(hidden: int, layers: int, vocab: int = 32000) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        vocab_size=vocab,
    )


def meta_init_flow(config: LlamaConfig) -> torch.nn.Module:
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


class PassThrough(TorchDispatchMode):
    """A dispatch mode that only runs each operation: what any Python dispatch mode costs a flow, the ledger's floor."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return func(*args, **(kwargs or {}))


install_dispatch_entry(PassThrough)  # entered as the ledger's mode is


def seconds(flow: Callable[[], torch.nn.Module], around: Callable[[], contextlib.AbstractContextManager[Any]]) -> float:
    gc.collect()
    start = time.process_time()
    with around():
        flow()
    return time.process_time() - start


def ratio(label: str, flow: Callable[[], torch.nn.Module], repeat: int, floor: bool = False) -> None:
    """Print the median of ``repeat`` runs of ``flow`` under the ledger against as many without it, alternating (and
    as many under ``PassThrough`` if ``floor``)."""
    arounds: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
        "without": contextlib.nullcontext,
        "ledger": watch,
    }
    if floor:
        arounds["floor"] = PassThrough
    taken: dict[str, list[float]] = {name: [] for name in arounds}
    for _ in range(repeat):
        for name, around in arounds.items():
            taken[name].append(seconds(flow, around))
    plain, watched = statistics.median(taken["without"]), statistics.median(taken["ledger"])
    # Each round runs the flow every way back to back: the median of the rounds' ratios is not moved by the machine
    # slowing down or speeding up between rounds, as a ratio of medians is.
    ratio = statistics.median(b / a for a, b in zip(taken["without"], taken["ledger"], strict=True))
    verdict = "within target" if ratio <= 1.2 else "ABOVE target 1.2x"
    runs = f"median of {repeat} rounds" if repeat > 1 else "one run"
    beside = ""
    if floor:
        floor_ratio = statistics.median(b / a for a, b in zip(taken["without"], taken["floor"], strict=True))
        beside = f"; any dispatch mode: {floor_ratio:.2f}x"
    print(f"{label:<50} {watched:7.3f} s vs {plain:7.3f} s: {ratio:5.2f}x  {verdict} ({runs}{beside})")


def ledger_memory(config: LlamaConfig) -> None:
    with watch() as ledger:
        model = meta_init_flow(config)
    table = ledger._session.table  # the benchmark looks inside: the intervals it keeps
    records = [table.record_of(tensor.untyped_storage()) for tensor in [*model.parameters(), *model.buffers()]]
    intervals = sum(len(record.writes) for record in records if record is not None)
    model_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    # an interval is a start, an end and a label reference in three lists (8 bytes each), plus a record per storage
    kept = intervals * 3 * 8 + len(table) * 200
    print(
        f"ledger memory for the model's {len(records)} tensors: {intervals} intervals in {len(table)} storages, "
        f"about {kept / 2**10:.1f} KiB for {model_bytes / 2**20:.0f} MiB of model ({kept / model_bytes:.2e} of it)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run of each, on smaller models")
    quick = parser.parse_args().quick
    torch.set_num_threads(1)
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    repeat = 1 if quick else 3
    loads = 1 if quick else 25
    big = llama(512, 8) if quick else llama(1024, 20)
    small = llama(384, 4) if quick else llama(640, 8)
    count = sum(p.numel() for p in LlamaForCausalLM._from_config(big).parameters()) if quick else 322_000_000
    start = time.process_time()
    with watch():  # the first watch of a process looks once at every module imported for loaders bound by name
        pass
    print(f"first watch of this process, empty: {1e3 * (time.process_time() - start):.1f} ms (later ones reuse it)")
    ratio(f"meta -> to_empty -> init_weights, Llama {count / 1e6:.0f}M", lambda: meta_init_flow(big), repeat)
    for config in (big, small):
        with tempfile.TemporaryDirectory() as directory:
            LlamaForCausalLM._from_config(config).save_pretrained(directory)
            saved = sum(p.numel() for p in LlamaForCausalLM._from_config(config).parameters())
            ratio(
                f"from_pretrained of a saved Llama {saved / 1e6:.0f}M",
                lambda directory=directory: LlamaForCausalLM.from_pretrained(directory),  # type: ignore[misc]
                loads,
                floor=True,
            )
    ledger_memory(big)


if __name__ == "__main__":
    sys.exit(main())
