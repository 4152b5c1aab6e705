"""What the host keeps of each owner's KV: :mod:`.sessions` (owners: session ids as
HMACs under their caller), :mod:`.prefix` (a request's prompt as chained block hashes),
:mod:`.prefix_index` (which places hold which prefixes, bounded, no I/O) and
:mod:`.store` (parked KV copies on disk, indexed in SQLite under a byte budget)."""
