"""The write ledger's engine: byte intervals per storage (``intervals``), what wrote them (``provenance``), the storage
table (``storages``), the dispatch mode that sees every write (``tracking``), the scoped wraps that tag checkpoint
data and ties (``sources``), and the classification of a module's tensors (``report``).

Outside the engine, only the public face ``modattrs.ledger`` uses these modules.
"""
