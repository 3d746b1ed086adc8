"""The write ledger: which bytes of a module's tensors were written while a flow ran, and by what.

After ``to_empty``, a tensor that nothing writes keeps whatever memory held, often finite and plausible. Checks of
values cannot tell such garbage from data; a ledger can, because it watches the writes themselves. Run a flow
(building on the meta device, ``to_empty``, initializing, loading a checkpoint, sharding) inside :func:`watch`, then
ask the ledger for a :class:`Report` on the module it made: every parameter and buffer, persistent or not, tied
names included, is *loaded* (under its checkpoint key), *initialized*, *computed*, *received* (from another rank),
*tied*, or has bytes *unwritten* (which call allocated them), *computed from unwritten* bytes, or *overwritten after
loading*, with byte ranges and the line of user code behind each write. :meth:`Report.check` raises one
:class:`LedgerError` naming every problem and its fix.

Nothing in torch changes at import. While a ledger watches, a dispatch mode is pushed in the watching thread, and a
few loaders and ``nn.Module`` methods are wrapped process-wide to tag checkpoint data and note ties; all of it ends
with the watch (``docs/ledger.rst`` lists it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from modattrs._ledger.report import Entry, LedgerError, Part, Report, Tie, report_of
from modattrs._ledger.session import Session

__all__ = ["Entry", "Ledger", "LedgerError", "Part", "Report", "Tie", "watch"]


class Ledger:
    """What one :func:`watch` saw written. Ask it for a :meth:`report` on a module, during the watch or after."""

    def __init__(self) -> None:
        self._session = Session()

    @property
    def watching(self) -> bool:
        return self._session.active

    def report(self, module: nn.Module) -> Report:
        """Classify every parameter and buffer of ``module`` (all names, tied ones too) by what wrote its bytes."""
        return report_of(self._session, module)

    def check(self, module: nn.Module) -> Report:
        """``report(module)``, checked: raise :class:`LedgerError` if a tensor has bytes nothing wrote, was computed
        from such bytes or lost loaded values, or a tie was lost; return the report otherwise."""
        report = self.report(module)
        report.check()
        return report


@contextlib.contextmanager
def watch() -> Iterator[Ledger]:
    """Watch every write in this thread (and every checkpoint read in the process) until the block ends.

    Storages are held weakly: the ledger costs a few intervals per storage the flow touched, and nothing for the
    tensors it frees. Watches nest; each sees everything inside it.

    Example::

        with modattrs.ledger.watch() as ledger:
            with torch.device("meta"):
                model = build()
            model.to_empty(device="cpu")
            model.init_weights()
        ledger.report(model).check()
    """
    ledger = Ledger()
    ledger._session.start()
    try:
        yield ledger
    finally:
        ledger._session.stop()


# Names defined in the engine say where users import them: in tracebacks, reprs and the docs.
for _public in (Entry, LedgerError, Part, Report, Tie):
    _public.__module__ = __name__
