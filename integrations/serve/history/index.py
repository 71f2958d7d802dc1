"""Recent history forms, indexed by their tokens: a compact trie per tenant salt, capped in tokens.

``HistoryIndex.remember(ids, salt, computed, source)`` stores a history form (``computed``: how
many of its leading tokens were computed, when no precompute covers the rest; None: all of them;
``source``: any object the caller keeps with it, e.g. the conversation it was rendered from);
``previous(prompt, salt)`` returns the stored form sharing the longest prefix with ``prompt`` (at
least ``min_shared`` tokens; of several, the most recently stored), or None; ``computed(ids, salt)``
and ``source(ids, salt)`` what was given for ``ids``. Forms shorter than ``min_shared`` are not kept.

Forms share their common prefixes (a system prompt, the earlier turns of a conversation) in a radix
trie whose edges are ``array('I')`` runs of tokens, so a lookup walks the prompt once: O(prompt)
token compares in a few C-speed slice compares per branch, whatever the number of forms stored.
The bound is on the tokens the trie holds (``capacity_tokens``: each distinct prefix token counts
once); past it, the least recently stored forms go first. Used from the event loop only.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

from radixcache.tokens import common_prefix

DEFAULT_CAPACITY_TOKENS = 1 << 20  # about 4 MiB of token runs


class _Node:
    __slots__ = ("edge", "children", "parent", "entry", "stamp")

    def __init__(self, edge: array, parent):
        self.edge = edge  # the tokens from the parent to this node
        self.children: dict = {}  # first token of the child's edge -> child
        self.parent = parent
        self.entry: _Entry | None = None  # a stored form ends here
        self.stamp = -1  # the newest entry's sequence number in this subtree


class _Entry:
    __slots__ = ("salt", "node", "seq", "computed", "source")

    def __init__(self, salt, node: _Node, seq: int, computed, source):
        self.salt, self.node, self.seq, self.computed, self.source = salt, node, seq, computed, source


class HistoryIndex:
    """See the module docstring."""

    def __init__(self, capacity_tokens: int = DEFAULT_CAPACITY_TOKENS, min_shared: int = 16):
        if not isinstance(capacity_tokens, int) or capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be an int >= 1, got {capacity_tokens!r}")
        self.capacity_tokens = capacity_tokens
        self.min_shared = min_shared
        self.tokens = 0  # tokens held on the trie's edges
        self._roots: dict = {}  # salt -> root _Node
        self._entries: OrderedDict = OrderedDict()  # _Entry -> None, least recently stored first
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, history_ids, salt: str | None = None, computed: int | None = None,
                 source=None) -> None:
        """Store ``history_ids`` under ``salt`` as the most recent form (again, if it was stored:
        ``computed`` and ``source`` are replaced)."""
        ids = array("I", history_ids)
        if len(ids) < self.min_shared:
            return
        node = self._insert(self._roots.setdefault(salt, _Node(array("I"), None)), ids)
        entry = node.entry
        if entry is None:
            entry = node.entry = _Entry(salt, node, 0, computed, source)
        else:
            self._entries.pop(entry)
        self._seq += 1
        entry.seq, entry.computed, entry.source = self._seq, computed, source
        self._entries[entry] = None
        while node is not None:
            node.stamp = self._seq
            node = node.parent
        while self.tokens > self.capacity_tokens and self._entries:
            self._forget(next(iter(self._entries)))

    def previous(self, prompt_ids, salt: str | None = None) -> tuple | None:
        """The stored form sharing the longest prefix (>= ``min_shared``) with ``prompt_ids``."""
        node, depth, _ = self._walk(salt, prompt_ids)
        if node is None or depth < self.min_shared:
            return None
        while node.entry is None or node.entry.seq != node.stamp:  # down to the newest form below
            node = next(c for c in node.children.values() if c.stamp == node.stamp)
        return self._ids(node)

    def computed(self, history_ids, salt: str | None = None) -> int | None:
        """The ``computed`` remembered with ``history_ids`` (None: all of it, or not stored)."""
        entry = self._entry(history_ids, salt)
        return None if entry is None else entry.computed

    def source(self, history_ids, salt: str | None = None):
        """The ``source`` remembered with ``history_ids`` (None when not stored)."""
        entry = self._entry(history_ids, salt)
        return None if entry is None else entry.source

    def _entry(self, history_ids, salt):
        node, depth, exact = self._walk(salt, history_ids)
        if node is None or not exact or depth != len(history_ids):
            return None
        return node.entry

    # ------------------------------------------------------------------ the trie
    def _walk(self, salt, ids):
        """``(node, depth, exact)``: how far ``ids`` goes down the trie; ``node`` is the deepest node
        whose subtree holds every form sharing ``depth`` tokens with ``ids`` (``exact``: the walk
        ended at that node, not inside its edge); ``(None, 0, False)`` without a root."""
        node = self._roots.get(salt)
        if node is None:
            return None, 0, False
        query = ids if type(ids) is array and ids.typecode == "I" else array("I", ids)
        depth = 0
        while depth < len(query):
            child = node.children.get(query[depth])
            if child is None:
                break
            edge = child.edge
            shared = common_prefix(edge, query[depth:depth + len(edge)])
            depth += shared
            if shared < len(edge):
                return child, depth, False
            node = child
        return node, depth, True

    def _insert(self, root: _Node, ids: array) -> _Node:
        node, depth = root, 0
        while depth < len(ids):
            child = node.children.get(ids[depth])
            if child is None:
                leaf = _Node(ids[depth:], node)
                node.children[ids[depth]] = leaf
                self.tokens += len(leaf.edge)
                return leaf
            shared = common_prefix(child.edge, ids[depth:depth + len(child.edge)])
            if shared < len(child.edge):  # split the edge where the form leaves it
                middle = _Node(child.edge[:shared], node)
                middle.stamp = child.stamp
                node.children[ids[depth]] = middle
                child.edge, child.parent = child.edge[shared:], middle
                middle.children[child.edge[0]] = child
                child = middle
            depth += shared
            node = child
        return node

    def _forget(self, entry: _Entry) -> None:
        del self._entries[entry]
        node = entry.node
        node.entry = None
        root = self._roots[entry.salt]
        while node is not root and node.entry is None and not node.children:  # prune the bare leaf
            del node.parent.children[node.edge[0]]
            self.tokens -= len(node.edge)
            node = node.parent
        if node is not root and node.entry is None and len(node.children) == 1:  # merge a bare link
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[child.edge[0]] = child
            node = child.parent
        while node is not None:
            newest = max((c.stamp for c in node.children.values()), default=-1)
            node.stamp = max(newest, node.entry.seq if node.entry is not None else -1)
            node = node.parent
        if not root.children:
            del self._roots[entry.salt]

    @staticmethod
    def _ids(node: _Node) -> tuple:
        edges = []
        while node is not None:
            edges.append(node.edge)
            node = node.parent
        out = array("I")
        for edge in reversed(edges):
            out.extend(edge)
        return tuple(out)
