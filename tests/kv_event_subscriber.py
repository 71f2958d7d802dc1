"""A KV-event subscriber as a router runs one (a real ZMQ SUB socket on loopback), the block set it
rebuilds, and the block set a tree holds, computed from the tree's nodes alone.

``BlockSet.apply`` checks every event against the layout (vLLM's ``array_like`` tagged structs:
``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name]``,
``["BlockRemoved", hashes, medium]``, ``["AllBlocksCleared"]``) and the stream's consistency (a
block is stored once, removed only while stored, a parent is a stored block).
"""

import time

import msgpack
import zmq

from radixcache.store.keys import block_digests, tree_namespace_digest

INT64 = (-(2**63), 2**63 - 1)


def event_hash(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big", signed=True)


class BlockSet:
    """What a router knows of one worker: hash -> (parent hash, block tokens), and the counts since
    the last ``AllBlocksCleared``. Until the first one it knows nothing and applies nothing."""

    def __init__(self, block_size, medium="GPU"):
        self.block_size, self.medium = block_size, medium
        self.blocks: dict = {}
        self.synced = False
        self.stored = self.removed = self.cleared = 0

    def apply(self, events):
        for event in events:
            assert isinstance(event, list) and event and isinstance(event[0], str), event
            kind = event[0]
            if kind == "AllBlocksCleared":
                assert event == ["AllBlocksCleared"]
                self.blocks.clear()
                self.synced = True
                self.stored = self.removed = 0
                self.cleared += 1
            elif kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                assert len(event) == 3 and event[2] == self.medium, event
                hashes = event[1]
                assert hashes and all(isinstance(h, int) for h in hashes), event
                if self.synced:
                    for h in hashes:
                        assert h in self.blocks, f"BlockRemoved of {h}, which is not stored"
                        del self.blocks[h]
                    self.removed += len(hashes)
            else:
                raise AssertionError(f"unknown event {event!r}")

    def _stored(self, event):
        assert len(event) == 8, event
        _, hashes, parent, tokens, block_size, lora_id, medium, lora_name = event
        assert block_size == self.block_size and lora_id is None and lora_name is None
        assert medium == self.medium
        assert hashes and all(isinstance(h, int) and INT64[0] <= h <= INT64[1] for h in hashes)
        assert len(tokens) == block_size * len(hashes), "token_ids must be whole blocks"
        assert parent is None or isinstance(parent, int)
        if not self.synced:
            return
        assert parent is None or parent in self.blocks, f"parent {parent} is not stored"
        for k, h in enumerate(hashes):
            assert h not in self.blocks, f"block {h} stored twice"
            self.blocks[h] = (parent if k == 0 else hashes[k - 1],
                              tuple(tokens[k * block_size:(k + 1) * block_size]))
        self.stored += len(hashes)


def tree_blocks(tree) -> dict:
    """hash -> (parent hash, tokens) of every whole block ``tree`` holds, from its nodes."""
    bs, out = tree.block_size, {}
    for node in tree.nodes():
        n = len(node.blocks)
        if len(node.key) < bs:  # a partial tail: never in events
            continue
        path, up = [], node
        while up is not None:
            path[:0] = up.key.tolist()
            up = up.parent
        depth = len(path) // bs
        digests = block_digests(tree_namespace_digest(node.namespace, bs), path, bs, depth)
        for i in range(depth - n, depth):
            parent = event_hash(digests[i - 1]) if i else None
            out[event_hash(digests[i])] = (parent, tuple(path[i * bs:(i + 1) * bs]))
    return out


class Subscriber(BlockSet):
    """A real SUB socket connected to a publisher's endpoint, applying every batch it receives and
    checking the message layout: 3 frames, the topic, consecutive 8-byte big-endian sequence
    numbers, ``[timestamp, events, dp_rank]``."""

    def __init__(self, endpoint, block_size, topic="kv", medium="GPU", dp_rank=0):
        super().__init__(block_size, medium)
        self.topic, self.dp_rank = topic.encode(), dp_rank
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.socket.connect(endpoint)
        self.last_seq = None
        self.batches = []   # (sequence, events) in arrival order
        self.payloads = []  # the raw msgpack of each

    def join(self, resync, flush, timeout=20.0):
        """Republish the state (``resync``, then ``flush``) until a batch arrives: the subscription
        is live from then on, and the state is known once an AllBlocksCleared has arrived."""
        deadline = time.monotonic() + timeout
        while not self.synced:
            assert time.monotonic() < deadline, "no KV event reached the subscriber"
            resync()
            flush()
            while self.socket.poll(50):
                self.receive_one()

    def receive_one(self):
        frames = self.socket.recv_multipart()
        assert len(frames) == 3, frames
        topic, seq, payload = frames
        assert topic == self.topic and len(seq) == 8
        seq = int.from_bytes(seq, "big")
        if self.last_seq is not None:
            assert seq == self.last_seq + 1, f"sequence {seq} after {self.last_seq}"
        self.last_seq = seq
        batch = msgpack.unpackb(payload)
        assert isinstance(batch, list) and len(batch) == 3, batch
        ts, events, dp_rank = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 3600 and dp_rank == self.dp_rank
        assert isinstance(events, list) and events, "a batch carries at least one event"
        self.batches.append((seq, events))
        self.payloads.append(payload)
        self.apply(events)

    def receive_until(self, batches, timeout=20.0):
        """Receive until the batch numbered ``batches - 1`` (the publisher's count) has arrived."""
        deadline = time.monotonic() + timeout
        while self.last_seq is None or self.last_seq < batches - 1:
            left = deadline - time.monotonic()
            assert left > 0, f"batch {batches - 1} never arrived (last {self.last_seq})"
            if self.socket.poll(int(left * 1000)):
                self.receive_one()

    def close(self):
        self.socket.close(linger=0)
        self.context.term()
