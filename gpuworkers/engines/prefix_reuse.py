"""Shared prompt prefixes computed once: the transformers engine's prefix KV caches.

Records of a batch file often share a long system prompt or few-shot preamble. `PrefixReuse.plan` finds,
in a micro-batch's prompt token ids, the prefixes that several prompts share (or that an earlier micro-batch
or shard left in its cache), computes each missing one's KV cache once, and says which prompts run on which
prefix; `prefixed_inputs` builds the ``generate`` arguments of a sub-batch that continues one prefix.

Prompts are cut into blocks of `BLOCK_TOKENS` token ids, each named by a hash chained over the blocks before
it (as vLLM's automatic prefix caching names its blocks), so two prompts share their first k blocks exactly
when their k-th hashes are equal, and a prefix is found in one dictionary look-up. A prefix always leaves a
prompt at least its last token to compute: the first generated token needs that token's logits.

What is shared is the prefix's keys and values, computed alone from position 0: a sub-batch's prompts
continue it with their suffixes right-aligned (``prefix, pads, suffix``), the pads masked out, and the
positions counted from the attention mask (transformers' ``generate`` does so), so each prompt sees what it
sees padded on the left without reuse, up to float rounding.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BLOCK_TOKENS = 16
"""Token ids a block; a shared prefix is a whole number of blocks. vLLM's default block size."""


@dataclass(frozen=True)
class PrefixKV:
    """One prefix's key and value tensors, each ``[1, heads, tokens, head_dim]``, one pair a layer."""

    token_ids: tuple[int, ...]
    """The prefix itself; a look-up compares it, so that a hash collision cannot serve another's cache."""
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    namespace: str = ""
    """The weights it was computed with: a LoRA adapter's key, empty for the base model alone (an adapter
    changes the attention's projections, so the same tokens have other keys and values under it)."""

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for pair in self.layers for tensor in pair)

    def first(self, tokens: int) -> PrefixKV:
        """The cache of this prefix's first ``tokens`` tokens: a view, since attention is causal."""
        if tokens == len(self.token_ids):
            return self
        return PrefixKV(
            self.token_ids[:tokens],
            tuple((k[:, :, :tokens], v[:, :, :tokens]) for k, v in self.layers),
            self.namespace,
        )


@dataclass
class PrefixPlan:
    """How one micro-batch runs: groups of prompts on a shared prefix, the rest as they are."""

    groups: list[tuple[PrefixKV, list[int]]] = field(default_factory=list)
    """Each shared prefix and the indices (into the micro-batch) of the prompts that continue it."""
    plain: list[int] = field(default_factory=list)
    """The prompts that share no prefix."""
    cached_tokens: list[int] = field(default_factory=list)
    """Per prompt, its tokens served from a prefix another prompt computed (this micro-batch or before):
    the prompt tokens it did not cost. The first prompt of a new prefix pays for it and counts 0."""


def no_prefixes(count: int) -> PrefixPlan:
    """The plan of a micro-batch of ``count`` prompts run without prefix reuse."""
    return PrefixPlan(plain=list(range(count)), cached_tokens=[0] * count)


class PrefixCache:
    """Prefix KV caches kept across micro-batches, least recently used out first, within a byte budget.

    Every block hash of a kept prefix finds it, so a prompt that shares only its first blocks is served a
    view of its first tokens.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, PrefixKV] = OrderedDict()
        """Kept prefixes by the hash of their last block, least recently used first."""
        self._by_block: dict[int, int] = {}
        """Each block hash of a kept prefix -> the key of the longest kept prefix holding it."""
        self._bytes = 0

    def find(self, block_hash: int, token_ids: list[int], tokens: int, namespace: str = "") -> PrefixKV | None:
        """The cache of ``token_ids[:tokens]`` (whose last block hashes to ``block_hash``) under the weights
        ``namespace`` names, or None."""
        key = self._by_block.get(block_hash)
        if key is None:
            return None
        entry = self._entries[key]
        if entry.namespace != namespace or len(entry.token_ids) < tokens:
            return None
        if entry.token_ids[:tokens] != tuple(token_ids[:tokens]):
            return None
        self._entries.move_to_end(key)
        return entry.first(tokens)

    def add(self, entry: PrefixKV, hashes: list[int]) -> None:
        """Keep ``entry`` (its blocks' chained ``hashes``), dropping the least recently used to fit."""
        size = entry.nbytes
        if size > self.budget_bytes or hashes[-1] in self._entries:
            return
        while self._bytes + size > self.budget_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[hashes[-1]] = entry
        self._bytes += size
        for block_hash in hashes:
            self._by_block[block_hash] = hashes[-1]

    def clear(self) -> None:
        self._entries.clear()
        self._by_block.clear()
        self._bytes = 0

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        for block_hash in block_hashes(list(entry.token_ids), len(entry.token_ids), namespace=entry.namespace):
            if self._by_block.get(block_hash) == key:
                del self._by_block[block_hash]


def block_hashes(token_ids: list[int], limit: int, *, namespace: str = "") -> list[int]:
    """The chained hash of each whole block of ``token_ids[:limit]``, under the weights ``namespace`` names."""
    hashes: list[int] = []
    previous = hash(namespace) if namespace else 0
    for start in range(0, limit - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        previous = hash((previous, *token_ids[start : start + BLOCK_TOKENS]))
        hashes.append(previous)
    return hashes


class PrefixReuse:
    """One engine's prefix reuse: plans each micro-batch on the shared prefixes, computing the missing ones.

    ``model`` is a loaded causal LM; ``min_tokens``, the fewest tokens a shared prefix must hold;
    ``cache_bytes``, the budget of prefixes kept for later micro-batches (0 keeps none).
    """

    def __init__(self, model: Any, *, min_tokens: int, cache_bytes: int) -> None:
        self._model = model
        self._min_blocks = max(1, -(-min_tokens // BLOCK_TOKENS))
        self.cache = PrefixCache(cache_bytes)

    def plan(self, token_ids: list[list[int]], *, model: Any = None, namespace: str = "") -> PrefixPlan:
        """Which prompts continue which shared prefix; computes (and keeps) the prefixes not yet cached, with
        ``model`` (the engine's, by default: a LoRA adapter's when one is active, named by ``namespace``)."""
        hashes = [block_hashes(ids, len(ids) - 1, namespace=namespace) for ids in token_ids]
        counts = Counter(block_hash for own in hashes for block_hash in own)
        # The prefixes this micro-batch computed, whether or not the engine's cache keeps them.
        computed = PrefixCache(budget_bytes=1 << 62)

        def found(index: int, blocks: int) -> PrefixKV | None:
            block_hash, tokens = hashes[index][blocks - 1], blocks * BLOCK_TOKENS
            return computed.find(block_hash, token_ids[index], tokens, namespace) or self.cache.find(
                block_hash, token_ids[index], tokens, namespace
            )

        def depth(index: int) -> int:
            """The prompt's deepest block (at least the minimum) that another prompt here shares or a cache holds."""
            own = hashes[index]
            return next(
                (
                    blocks
                    for blocks in range(len(own), self._min_blocks - 1, -1)
                    if counts[own[blocks - 1]] > 1 or found(index, blocks) is not None
                ),
                0,
            )

        depths = [depth(index) for index in range(len(token_ids))]
        plan = PrefixPlan(cached_tokens=[0] * len(token_ids))
        groups: dict[tuple[int, tuple[int, ...]], tuple[PrefixKV, list[int]]] = {}
        # Deepest first, so that a prompt sharing fewer blocks is served a view of a longer prefix.
        for index in sorted(range(len(token_ids)), key=lambda i: (-depths[i], i)):
            blocks = depths[index]
            if not blocks:
                plan.plain.append(index)
                continue
            prefix = found(index, blocks)
            if prefix is not None:
                plan.cached_tokens[index] = len(prefix.token_ids)
            else:
                ancestor = next((view for b in range(blocks - 1, 0, -1) if (view := found(index, b))), None)
                prefix = self._compute(token_ids[index][: blocks * BLOCK_TOKENS], ancestor, model, namespace)
                plan.cached_tokens[index] = 0 if ancestor is None else len(ancestor.token_ids)
                computed.add(prefix, hashes[index][:blocks])
                self.cache.add(prefix, hashes[index][:blocks])
            key = (hashes[index][blocks - 1], prefix.token_ids)
            groups.setdefault(key, (prefix, []))[1].append(index)
        plan.groups = [(prefix, sorted(members)) for prefix, members in groups.values()]
        plan.plain.sort()
        return plan

    def _compute(self, prefix_ids: list[int], ancestor: PrefixKV | None, model: Any, namespace: str) -> PrefixKV:
        """The KV cache of ``prefix_ids``, continuing ``ancestor`` (a cached prefix of it) where there is one."""
        import torch

        model = model if model is not None else self._model
        done = 0 if ancestor is None else len(ancestor.token_ids)
        cache = None if ancestor is None else dynamic_cache(ancestor, rows=1)
        remaining = torch.tensor([prefix_ids[done:]], device=model.device)
        with torch.inference_mode():
            output = model(input_ids=remaining, use_cache=True, **{cache_kwarg(model): cache})
        kept = output["cache"] if "cache" in output else output["past_key_values"]
        layers = tuple((keys, values) for keys, values in layer_tensors(kept))
        return PrefixKV(tuple(prefix_ids), layers, namespace)


def sub_batches(plan: PrefixPlan, token_ids: list[list[int]], step: int) -> Iterator[tuple[list[int], PrefixKV | None]]:
    """The micro-batch's sub-batches of at most ``step`` prompts, each with the prefix its prompts continue.

    Longest first within a prefix's group and among the plain prompts, so that each sub-batch pads little
    and an out-of-memory error, if one comes, comes early.
    """
    runs: list[tuple[list[int], PrefixKV | None]] = [(members, prefix) for prefix, members in plan.groups]
    runs.append((plan.plain, None))
    for members, prefix in runs:
        order = sorted(members, key=lambda i: len(token_ids[i]), reverse=True)
        for start in range(0, len(order), step):
            yield order[start : start + step], prefix


def prefixed_inputs(prefix: PrefixKV, token_ids: list[list[int]], *, pad_id: int, model: Any) -> dict[str, Any]:
    """``generate``'s keyword arguments for prompts that all begin with ``prefix``: each row is the prefix,
    pads, then the prompt's suffix (right-aligned, as left padding aligns whole prompts), with the pads
    masked out; the prefix's cache, repeated for each row, spares its computation."""
    import torch

    shared = len(prefix.token_ids)
    width = max(len(ids) for ids in token_ids) - shared
    rows, masks = [], []
    for ids in token_ids:
        suffix = ids[shared:]
        pads = width - len(suffix)
        rows.append([*prefix.token_ids, *[pad_id] * pads, *suffix])
        masks.append([1] * shared + [0] * pads + [1] * len(suffix))
    return {
        "input_ids": torch.tensor(rows, device=model.device),
        "attention_mask": torch.tensor(masks, device=model.device),
        cache_kwarg(model): dynamic_cache(prefix, rows=len(rows)),
    }


def dynamic_cache(prefix: PrefixKV, *, rows: int) -> Any:
    """A fresh ``DynamicCache`` holding ``prefix`` for each of ``rows`` rows; ``generate`` grows it in place,
    so the kept tensors are only viewed (expanded), never written."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (keys, values) in enumerate(prefix.layers):
        cache.update(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), layer)
    return cache


def layer_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) of a ``DynamicCache``: its ``layers`` since transformers 4.56, its
    ``key_cache`` and ``value_cache`` lists before."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def cache_kwarg(model: Any) -> str:
    """The name under which the model takes a KV cache: ``cache`` since transformers 5.x renamed
    ``past_key_values`` (which still works there, with a deprecation warning a call)."""
    import inspect

    # A PEFT model (a LoRA adapter loaded) passes every keyword through to the model it wraps.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
