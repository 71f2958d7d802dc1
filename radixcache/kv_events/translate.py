"""From the tree's block records to vLLM's KV events, with each cached block's chained digest.

Runs on the publisher's thread, in record order. Every whole block the tree adopts gets its
chained BLAKE2b digest (``radixcache.store.keys.chain_digests``, from ``tree_namespace_digest`` of
its namespace for the first block of a sequence, else from its parent block's digest), kept per
pool block id until the block leaves the tree; ``BlockRemoved`` names it by that digest. A block id
with no digest kept was never announced (a partial tail) and is left out.

The events, as lists that msgpack encodes exactly like vLLM's ``msgspec`` structs (``array_like``,
``tag=True``: the class name first, then the fields in order)::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

``block_hashes``: the first 8 bytes of each block's digest as a signed big-endian int64;
``parent_block_hash``: that of the block before the first one, None at the start of a sequence;
``token_ids``: the tokens of every block, ``block_size`` per hash; ``lora_id`` and ``lora_name``:
None (a tenant's salt is in the hash, through the namespace); ``medium``: the publisher's.
"""

from __future__ import annotations

import sys
from array import array

from radixcache.kv_events.log import REMOVED, STORED, SYNC
from radixcache.store.keys import DIGEST_SIZE, chain_digests, tree_namespace_digest

_LITTLE = sys.byteorder == "little"


def block_hash(digest: bytes) -> int:
    """The event name of a block: the first 8 bytes of its digest, a signed big-endian int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


def _le(packed: bytes) -> bytes:
    """Packed native-order uint32 tokens as the little-endian bytes the digests hash."""
    if _LITTLE:
        return packed
    a = array("I", packed)
    a.byteswap()
    return a.tobytes()


class EventTranslator:
    """Records in, event lists out (see the module docstring); keeps the digest of every whole
    block the tree holds, by pool block id (32 bytes and a 4-byte namespace slot per pool block)."""

    def __init__(self, medium: str | None):
        self.block_size = 0            # the tree's, from its first snapshot
        self.medium = medium
        self.digests = bytearray()
        self.slot = array("I")         # per block id: 1 + index into namespaces, 0 when none kept
        self.namespaces: list = []     # (namespace digest) per slot - 1
        self.slot_of: dict = {}        # namespace tuple -> its slot

    def translate(self, record) -> list:
        """The events of one record (none for a removal of blocks never announced)."""
        kind = record[0]
        if kind == STORED:
            return [self._stored(*record[1:])]
        if kind == REMOVED:
            hashes = self._forget(record[1])
            return [["BlockRemoved", hashes, self.medium]] if hashes else []
        if kind == SYNC:
            return self._sync(*record[1:])
        raise ValueError(f"unknown KV event record {kind!r}")

    # ------------------------------------------------------------------ records
    def _sync(self, num_blocks: int, block_size: int, entries) -> list:
        self.block_size = block_size
        self.digests = bytearray(DIGEST_SIZE * num_blocks)
        self.slot = array("I", bytes(4 * num_blocks))
        self.namespaces, self.slot_of = [], {}
        return [["AllBlocksCleared"]] + [self._stored(*entry) for entry in entries]

    def _stored(self, parent_blocks, namespace, key: bytes, blocks: bytes) -> list:
        digests, slots = self.digests, self.slot
        if parent_blocks is None:
            slot = self._slot(namespace)
            parent, parent_hash = b"", None
        else:
            p = array("I", parent_blocks[-4:])[0]
            slot = slots[p]
            if not slot:
                raise ValueError(f"BlockStored below block {p}, which holds no announced digest")
            parent = bytes(digests[DIGEST_SIZE * p:DIGEST_SIZE * (p + 1)])
            parent_hash = block_hash(parent)
        chain = chain_digests(self.namespaces[slot - 1], parent, _le(key), self.block_size)
        ids = array("I", blocks)
        if len(chain) != len(ids):
            raise ValueError(f"BlockStored: {len(ids)} block ids for {len(chain)} whole blocks")
        for b, d in zip(ids, chain):
            digests[DIGEST_SIZE * b:DIGEST_SIZE * (b + 1)] = d
            slots[b] = slot
        return ["BlockStored", [block_hash(d) for d in chain], parent_hash, array("I", key).tolist(),
                self.block_size, None, self.medium, None]

    def _forget(self, ids: bytes) -> list:
        digests, slots = self.digests, self.slot
        hashes = []
        for b in array("I", ids):
            if slots[b]:
                slots[b] = 0
                hashes.append(int.from_bytes(digests[DIGEST_SIZE * b:DIGEST_SIZE * b + 8], "big",
                                             signed=True))
        return hashes

    def _slot(self, namespace) -> int:
        slot = self.slot_of.get(namespace)
        if slot is None:
            self.namespaces.append(tree_namespace_digest(namespace, self.block_size))
            slot = self.slot_of[namespace] = len(self.namespaces)
        return slot
