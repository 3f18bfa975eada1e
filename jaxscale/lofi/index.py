"""Finding committed checkpoints without listing chunk files.

Listing every key under `workers/` would list every chunk file of every push: minutes and real
money on a big bucket. So each checkpoint also gets an empty key `index/<prefix>`, written just
before its COMMIT, and readers list `index/<root>/` instead.

The index of a root (`workers` or `average`) is trusted only once its marker
`index/<root>.complete` exists. The first writer of a store that has none (a new store, or one
written before the index existed) first indexes every committed checkpoint it finds by a full
scan, then writes the marker; from then on every writer indexes its own checkpoints. Without
the marker, readers scan key by key, so checkpoints of an older store never go missing.

A process of a jaxscale older than the index that keeps writing into an indexed store would
write checkpoints the index does not list: `repair` (`launch.lofi_average --repair_index`)
finds, indexes and names them.
"""

from __future__ import annotations

from jaxscale.lofi.kv import Store

INDEX = "index"


def _marker(root: str) -> str:
    return f"{INDEX}/{root}.complete"


def _numeric(prefixes: list[str], root: str) -> dict[tuple[int, ...], str]:
    """{numeric path parts below `root`: prefix} (anything else under `root` is ignored)."""
    out = {}
    for prefix in prefixes:
        parts = prefix[len(root) + 1:].split("/")
        if all(p.isdigit() for p in parts):
            out[tuple(int(p) for p in parts)] = prefix
    return out


def _listed(store: Store, root: str) -> dict[tuple[int, ...], str]:
    """The index's entries for `root` (possibly naming partial writes: see `committed`)."""
    return _numeric([k[len(INDEX) + 1:] for k in store.keys(f"{INDEX}/{root}/")], root)


def _scanned(store: Store, root: str) -> dict[tuple[int, ...], str]:
    """Every directory under `root` with a COMMIT, found by listing every key (slow)."""
    return _numeric([k[:-len("/COMMIT")] for k in store.keys(root + "/")
                     if k.endswith("/COMMIT")], root)


def add_entry(store: Store, prefix: str) -> None:
    """Indexes `prefix` (call before writing its COMMIT), first completing the index of its
    root if this store has none yet (once per store and root)."""
    root = prefix.split("/", 1)[0]
    if root not in store.indexed_roots:
        if store.read(_marker(root)) is None:
            _add_all(store, list(_scanned(store, root).values()))
            store.write(_marker(root), b"", if_absent=True)  # only after every entry landed
        store.indexed_roots.add(root)
    store.write(f"{INDEX}/{prefix}", b"", if_absent=True)


def _add_all(store: Store, prefixes: list[str]) -> None:
    """Index entries for `prefixes`, written concurrently (empty keys: rewriting one is
    harmless)."""
    for write in [store.kv.write(f"{INDEX}/{p}", b"") for p in prefixes]:
        write.result()


def repair(store: Store) -> list[str]:
    """Indexes committed checkpoints that a complete index does not list (written by a
    jaxscale older than the index) and returns them. Lists every key: run once per start."""
    missing = []
    for root in ("workers", "average"):
        if store.read(_marker(root)) is None:
            continue  # scanned by every reader anyway
        listed = _listed(store, root)
        missing += [p for parts, p in sorted(_scanned(store, root).items())
                    if parts not in listed]
    _add_all(store, missing)
    return missing


def committed(store: Store, root: str, exact: bool = True) -> dict[tuple[int, ...], str]:
    """{numeric path parts: prefix} of every directory under `root` holding a COMMIT.

    Lists the index, then keeps the entries whose COMMIT exists, read together: the index
    entry precedes its COMMIT, so it may name a partial write (`exact=False` skips that check,
    for callers that load each entry anyway). A root without a complete index is scanned."""
    if store.read(_marker(root)) is None:
        return _scanned(store, root)
    indexed = _listed(store, root)
    if not exact:
        return indexed
    markers = {parts: store.kv.read(f"{prefix}/COMMIT") for parts, prefix in indexed.items()}
    out = {}
    for parts, future in markers.items():
        result = future.result()
        if result.state == "value":
            store.bytes_read += len(result.value)
            out[parts] = indexed[parts]
    return out
