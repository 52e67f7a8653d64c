"""Captured decode steps (cache/room.py): torch.compile(model, fullgraph=True) of a patched model's decode step,
checked against the same steps run eagerly on a cache without a reserve.

Static shapes are checked with dynamic=False: every Python int a traced step read, and every shape it saw, is then a
guard, so a step that read a count changing per step, or grew a tensor, would compile again at the next step. A
backend that records each graph counts the compilations; fullgraph=True turns any graph break (a host sync, an
untraceable call) into an error.
"""

import pytest
import torch
import torch._dynamo as dynamo

import kvpress
from kvpress import KVPressCache
from tests.conftest import counter_bytes, tiny_model

CODEC = dict(bits=4, group_size=16, residual_length=16)
CUTS = dict(compression_ratio=0.5, slack=4)  # decode-time evictors cut every 5 steps
CASES = [("none", "none", {}), ("snapkv", "snapkv", dict(compression_ratio=0.5, window_size=8)),
         ("keydiff", "keydiff", dict(compression_ratio=0.5)),
         ("kvzap", "kvzap", dict(compression_ratio=0.5, budget_allocation="uniform")),
         ("kivi", "kivi", CODEC), ("gear", "gear", CODEC),
         ("zipcache", "zipcache", dict(group_size=16, residual_length=16)),
         ("snapkv+kivi", "snapkv+kivi", dict(compression_ratio=0.5, **CODEC)),
         ("h2o", "h2o", CUTS), ("tova", "tova", CUTS), ("streaming_llm", "streaming_llm", CUTS),
         ("snapkv decode_budget", "snapkv", dict(compression_ratio=0.5, decode_budget=8, slack=4)),
         ("quest", "quest", dict(budget=48, page_size=8))]
PROMPT, STEPS = 60, 20


class Graphs:
    """A torch.compile backend that runs each graph as traced and records it."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def scalar_inputs(self) -> int:
        return sum(node.op == "placeholder" and not isinstance(node.meta.get("example_value"), torch.Tensor)
                   for gm in self.graphs for node in gm.graph.nodes)


def _decode_both(policy, params, reserve, steps=STEPS, calibration=None, padding=0):
    """Prefill one prompt into two caches, then decode `steps` greedy tokens: eagerly on a cache without a reserve,
    and through torch.compile(fullgraph=True, dynamic=False) on one with `reserve`. Returns (graphs, compilations
    seen after each step, the two caches, the layers' (slots of low-bit codes, view widths) after each eager
    step)."""
    if calibration is not None:
        params = dict(params, calibration=str(calibration))
    model = tiny_model("llama")
    rows = 2 if padding else 1
    ids = torch.randint(3, 128, (rows, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[-1, :padding] = 0  # the last row is left-padded (the cache keeps which slots are padding)
    graphs, counts, codes = Graphs(), [], []
    dynamo.reset()
    with kvpress.patch_model(model, policy, **params), torch.no_grad():
        eager, captured = KVPressCache(model.config), KVPressCache(model.config, capture_reserve=reserve)
        token = model(ids, cache=eager, attention_mask=mask).logits[:, -1:].argmax(-1)
        model(ids, cache=captured, attention_mask=mask)
        step = torch.compile(model, fullgraph=True, dynamic=False, backend=graphs)
        for i in range(steps):
            position = torch.tensor([[PROMPT + i]]) - (mask == 0).sum(-1, keepdim=True)
            want = model(token, cache=eager, position_ids=position).logits
            got = step(token, cache=captured, position_ids=position).logits
            torch.testing.assert_close(got, want)
            token = want[:, -1:].argmax(-1)
            counts.append(len(graphs.graphs))
            codes.append(tuple((0 if not layer.codes else layer.codes[0].num_slots, layer.view_width)
                               for _, layer in eager.kvpress_layers()))
    dynamo.reset()
    return graphs, counts, eager, captured, codes


@pytest.mark.parametrize("policy,params", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_captured_decode_step_equals_eager_and_keeps_its_shapes(policy, params, llama_file):
    """Every step's logits equal the eager step's; the step compiles once, and again only after a step that moved
    tokens into low-bit codes (an event: the codes' shapes change); a decode-time evictor's cut (every slack + 1
    steps, on the host) leaves the room's shapes as they were: no new compilation. No graph takes a Python number."""
    graphs, counts, eager, captured, shapes = _decode_both(policy, params, reserve=32,
                                                           calibration=llama_file if policy == "kvzap" else None)
    # a flush in step i's settling (after its graph) changes the shapes step i + 1 traces
    flushes = [i for i in range(1, STEPS) if shapes[i][0][0] != shapes[i - 1][0][0]]
    assert counts == [1 + sum(f < i for f in flushes) for i in range(STEPS)]
    if any(codec in policy for codec in ("kivi", "gear", "zipcache")):
        assert flushes, "the steps should cross a low-bit flush"
    else:
        assert counts == [1] * STEPS
    if params.get("slack"):
        cuts = [i for i in range(1, STEPS) if shapes[i][0][1] < shapes[i - 1][0][1]]
        assert len(cuts) >= 2, "the steps should cross cuts"
    assert graphs.scalar_inputs() == 0
    for (_, a), (_, b) in zip(eager.kvpress_layers(), captured.kvpress_layers()):
        assert (a.seen, a.appended, a.view_width, a.quantized_len) == (b.seen, b.appended, b.view_width,
                                                                       b.quantized_len)
        torch.testing.assert_close(a.keys_view(), b.keys_view())
        assert torch.equal(a.key_positions(), b.key_positions()) and torch.equal(a.key_valid(), b.key_valid())


@pytest.mark.parametrize("policy,params", [("quest", dict(budget=48, page_size=8)), ("h2o", CUTS),
                                           ("snapkv+kivi", dict(compression_ratio=0.5, **CODEC))])
def test_a_left_padded_batch_decodes_captured_as_eager(policy, params):
    """A batch whose second row is left-padded (pages and budgets count from its first real token): the captured
    steps, given no mask (the cache knows the padding), equal the eager ones."""
    graphs, counts, _, _, shapes = _decode_both(policy, params, reserve=32, padding=7)
    flushes = [i for i in range(1, STEPS) if shapes[i][0][0] != shapes[i - 1][0][0]]
    assert counts == [1 + sum(f < i for f in flushes) for i in range(STEPS)]
    assert graphs.scalar_inputs() == 0


def test_the_reserve_is_counted_and_bounded():
    """The room's buffers are in nbytes whole (reserved + used), and a room holds the tail + the reserve at most."""
    _, _, eager, captured, _ = _decode_both("snapkv", dict(compression_ratio=0.5, window_size=8), reserve=8, steps=6)
    for (_, a), (_, b) in zip(eager.kvpress_layers(), captured.kvpress_layers()):
        room = b.room
        assert room.capacity <= room.filled + 1 + 8
        tail = b.tail
        used = sum(t.numel() * t.element_size() for t in (tail.data.keys, tail.data.values))
        held = sum(t.numel() * t.element_size() for t in (room.segment.data.keys, room.segment.data.values))
        assert held > used  # reserved slots ...
        rest = sum(t.numel() * t.element_size() for s in b.segments[:-1] for t in s.tensors())
        room_bytes = sum(t.numel() * t.element_size() for t in room.tensors())
        assert b.nbytes() == rest + room_bytes + counter_bytes(b)  # ... all counted
    reserved = [row["reserved_slots"] for row in captured.stats()]
    assert reserved == [layer.room.capacity - layer.room.filled for _, layer in captured.kvpress_layers()]
    assert min(reserved) > 0 and [row["reserved_slots"] for row in eager.stats()] == [0] * len(reserved)


def test_a_used_up_reserve_grows_as_an_event():
    """With a reserve of 4 the room grows every few steps: the step compiles again then (new shapes), and only then;
    the tokens stay the eager ones."""
    _, counts, _, captured, _ = _decode_both("none", {}, reserve=4, steps=12)
    growths = len(set(counts))
    assert 2 <= growths <= 4 and counts == sorted(counts)


def test_the_model_hooks_run_outside_the_graph():
    """The patch's model-level hooks (argument checks, the thread-safety count of calls in flight) run on every call
    of the compiled model: a bad argument is refused by the compiled step too, and no call stays counted."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5) as patch, torch.no_grad():
        cache = KVPressCache(model.config, capture_reserve=8)
        token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
        step = torch.compile(model, fullgraph=True, backend=Graphs())
        step(token, cache=cache, position_ids=torch.tensor([[20]]))
        with pytest.raises(ValueError, match="output_attentions"):
            step(token, cache=cache, position_ids=torch.tensor([[21]]), output_attentions=True)
        assert cache.patched_forwards == 0 and patch._running == 0
    dynamo.reset()


@pytest.mark.parametrize("reserve", [0, -1, 1.5, True, "8", 2 ** 40, 1025])
def test_capture_reserve_is_checked(reserve):
    """Bounded by the model's context (1024 positions for the tiny Llama): 2**40 was accepted and failed in the
    allocator at the first step."""
    with pytest.raises(ValueError, match="capture_reserve"):
        KVPressCache(tiny_model("llama").config, capture_reserve=reserve)
    assert KVPressCache(tiny_model("llama").config, capture_reserve=1024).capture_reserve == 1024


# what captures, among the registered policies and compositions below (README, "torch.compile and CUDA graphs"): the
# rest is refused with its reason
CAPTURABLE = {"none", "snapkv", "keydiff", "knorm", "random", "expected_attention", "laq", "kvzap uniform", "kivi",
              "gear", "zipcache", "quest", "h2o slack", "tova slack", "streaming_llm slack", "snapkv decode_budget slack",
              "duo_attention all heads", "snapkv+kivi", "snapkv+zipcache", "kvzap uniform+kivi"}


def _registry_cases() -> dict:
    """case -> (policy, parameters): every registered policy and composition as test_padding.py runs them, and the
    options that decide whether a decode step captures."""
    from tests.test_padding import COMPOSED, PARAMS
    cases = {name: (name, params) for name, params in {**PARAMS, **COMPOSED}.items()}
    cases.update({"kvzap uniform": ("kvzap", dict(PARAMS["kvzap"], budget_allocation="uniform")),
                  "kvzap uniform+kivi": ("kvzap+kivi", dict(compression_ratio=0.5, budget_allocation="uniform",
                                                            calibration=None, **CODEC)),
                  "snapkv decode_budget slack": ("snapkv", dict(PARAMS["snapkv"], decode_budget=8, slack=4)),
                  "duo_attention all heads": ("duo_attention", dict(PARAMS["duo_attention"], streaming_heads=1.0))})
    cases.update({f"{name} slack": (name, dict(PARAMS[name], slack=3)) for name in ("h2o", "tova", "streaming_llm")})
    return cases


REGISTRY = _registry_cases()


@pytest.mark.parametrize("case", sorted(REGISTRY))
def test_every_registered_policy_captures_or_is_refused_before_anything_changes(case, llama_file):
    """Every registered policy and composition (and the options that change the answer): six captured steps
    (fullgraph, dynamic=False) equal the eager ones, or the reserved cache's first forward is refused with the
    policy's reason (cache/room.py cannot keep its step's shapes), leaving the cache empty."""
    policy, params = REGISTRY[case]
    params = {k: (str(llama_file) if k == "calibration" else v) for k, v in params.items()}
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(0))
    dynamo.reset()
    with kvpress.patch_model(model, policy, **params) as patch, torch.no_grad():
        eager, captured = KVPressCache(model.config), KVPressCache(model.config, capture_reserve=16)
        if patch.policy.capture_refusal:
            with pytest.raises(ValueError, match=r"capture_reserve=16\): .*which a decode step of fixed shapes"):
                model(ids, cache=captured)
            assert captured.get_seq_length() == 0 and case not in CAPTURABLE
            return
        assert case in CAPTURABLE
        token = model(ids, cache=eager).logits[:, -1:].argmax(-1)
        model(ids, cache=captured)
        step = torch.compile(model, fullgraph=True, dynamic=False, backend=Graphs())
        for i in range(6):
            position = torch.tensor([[90 + i]])
            want = model(token, cache=eager, position_ids=position).logits
            torch.testing.assert_close(step(token, cache=captured, position_ids=position).logits, want)
            token = want[:, -1:].argmax(-1)
    dynamo.reset()


def test_a_model_with_stock_sliding_layers_refuses_a_reserve():
    """Gemma-3's sliding-window layers are transformers' own: their decode steps change shape every step."""
    with pytest.raises(ValueError, match="capture_reserve=8: .*sliding-window"):
        KVPressCache(tiny_model("gemma3").config, capture_reserve=8)


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "mistral"])
def test_other_architectures_capture(arch):
    """Qwen3 (q/k norms), Phi-3 (fused qkv), Mistral: ten captured snapkv steps equal eager, through one graph."""
    model = tiny_model(arch)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    graphs = Graphs()
    dynamo.reset()
    with kvpress.patch_model(model, "snapkv", compression_ratio=0.5), torch.no_grad():
        eager, captured = KVPressCache(model.config), KVPressCache(model.config, capture_reserve=16)
        token = model(ids, cache=eager).logits[:, -1:].argmax(-1)
        model(ids, cache=captured)
        step = torch.compile(model, fullgraph=True, dynamic=False, backend=graphs)
        for i in range(10):
            position = torch.tensor([[40 + i]])
            want = model(token, cache=eager, position_ids=position).logits
            torch.testing.assert_close(step(token, cache=captured, position_ids=position).logits, want)
            token = want[:, -1:].argmax(-1)
    assert len(graphs.graphs) == 1
    dynamo.reset()


@pytest.mark.parametrize("policy,params", [("h2o", dict(compression_ratio=0.5)), ("retrieval", dict(budget=24))])
def test_a_policy_that_changes_decode_steps_refuses_a_reserve(policy, params):
    """Eviction at every step (slack 0) and read views other than quest do not capture (yet): a cache with a reserve
    is refused with the reason, before the forward changes anything."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    with kvpress.patch_model(model, policy, **params), torch.no_grad():
        cache = KVPressCache(model.config, capture_reserve=8)
        with pytest.raises(ValueError, match="capture_reserve=8"):
            model(ids, cache=cache)
        assert cache.get_seq_length() == 0


def test_a_fork_keeps_its_tokens_while_the_original_decodes_into_its_room():
    """A room is written in place; a fork shares the tail's tensors, so the original gives up its room and the fork's
    tokens never change."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    with kvpress.patch_model(model, "none"), torch.no_grad():
        cache = KVPressCache(model.config, capture_reserve=16)
        token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
        for _ in range(3):
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
        fork = cache.fork()
        before = [(layer.keys_view().clone(), layer.key_positions().clone()) for _, layer in fork.kvpress_layers()]
        cache.crop(-2)
        for _ in range(4):
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
        for (keys, positions), (_, layer) in zip(before, fork.kvpress_layers()):
            assert torch.equal(layer.keys_view(), keys) and torch.equal(layer.key_positions(), positions)


@pytest.mark.parametrize("policy,params", [("none", {}), ("snapkv+kivi", dict(compression_ratio=0.5, **CODEC)),
                                           ("h2o", CUTS), ("quest", dict(budget=48, page_size=8))])
def test_generate_on_a_cache_with_a_reserve_gives_the_same_tokens(policy, params):
    """Eager generate (a left-padded batch, the mask given every step) on a cache with a reserve: every step appends
    into the room and is counted at once; the tokens are those of a cache without one."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 50), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    outputs = []
    with kvpress.patch_model(model, policy, **params), torch.no_grad():
        for cache in (KVPressCache(model.config), KVPressCache(model.config, capture_reserve=8)):
            outputs.append(model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=12, min_new_tokens=12,
                                          do_sample=False))
        assert cache.stats()[0]["reserved_slots"] > 0
    assert torch.equal(outputs[0], outputs[1])
