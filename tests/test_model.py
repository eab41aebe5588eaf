"""The reference GPT: shapes, attention semantics, determinism, the parameter/FLOP formulas, and the
mixture-of-experts layer (routers, capacity, balancing losses, router bias), each against a direct
computation."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from picotron_like.model import (GPT, PRESETS, GPTConfig, SwiGLU, count_parameters, flops_per_token, get_config,
                                 reference_init)
from picotron_like.moe import (BatchShare, MixtureOfExperts, capacity_mask, choice_counts, expert_capacity,
                               looped_expert_compute, moe_layers)
from picotron_like.train import build_optimizer

TINY = replace(get_config("tiny"), n_layers=2)
MOE = replace(get_config("tiny-moe"), n_layers=2)


def explicit_attention(q, k, v):
    """Causal attention written out: query head i reads K/V head i // (heads / kv_heads)."""
    group = q.shape[1] // k.shape[1]
    seq = q.shape[2]
    out = torch.empty_like(q)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    for head in range(q.shape[1]):
        scores = q[:, head] @ k[:, head // group].transpose(-1, -2) / math.sqrt(q.shape[-1])
        out[:, head] = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, head // group]
    return out


def test_shapes_and_loss():
    model = GPT(TINY, seed=0)
    # Tokens of a fixed draw: the loss of random tokens scatters by ~0.05 around log V, and the
    # global generator's state depends on which tests ran before this one.
    tokens = torch.randint(0, TINY.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    assert model(tokens).shape == (3, 16, TINY.vocab_size)
    loss = model(tokens, tokens)
    assert loss.shape == () and math.isfinite(loss.item())
    # An untrained model is close to uniform over the vocabulary.
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.1


def test_grouped_query_attention_matches_explicit_formula():
    assert TINY.n_kv_heads < TINY.n_heads
    model = GPT(TINY, seed=1)
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    expected = model(tokens)
    for layer in model.layers:
        layer.attn.attention_core = explicit_attention
    torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)
    assert model.layers[0].attn.k_proj.weight.shape == (TINY.n_kv_heads * TINY.head_dim, TINY.hidden)


def test_causal_future_tokens_do_not_change_the_past():
    model = GPT(TINY, seed=2)
    tokens = torch.randint(0, TINY.vocab_size, (1, 10))
    changed = tokens.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % TINY.vocab_size
    torch.testing.assert_close(model(tokens)[:, :6], model(changed)[:, :6])
    assert not torch.allclose(model(tokens)[:, 6:], model(changed)[:, 6:])


def test_positions_are_explicit_rotations():
    """Shifting every position by the same offset leaves attention unchanged (RoPE is relative)."""
    model = GPT(TINY, seed=3)
    tokens = torch.randint(0, TINY.vocab_size, (1, 8))
    shifted = model(tokens, positions=torch.arange(8) + 100)
    torch.testing.assert_close(model(tokens), shifted, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cfg", [TINY, replace(MOE, n_shared_experts=1)])
def test_initialisation_is_a_function_of_seed_and_name(cfg):
    a, b, c = GPT(cfg, seed=5), GPT(cfg, seed=5), GPT(cfg, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa, reference_init(name, pa.shape, cfg, seed=5)), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    q0, q1 = a.layers[0].attn.q_proj.weight, a.layers[1].attn.q_proj.weight
    assert not torch.equal(q0, q1)
    # Residual-stream projections start smaller, so the residual does not grow with depth.
    assert a.layers[0].attn.o_proj.weight.std() < 0.7 * q0.std()


def test_stacked_expert_weights_are_drawn_whole():
    """Each 3-D expert tensor is one draw from its name: an expert-parallel rank that draws it and keeps
    dim-0 slice [2:4] holds exactly experts 2 and 3 of the reference. Experts differ from each other,
    the residual-writing experts.down_proj starts smaller, and the optimizer decays expert weights."""
    model = GPT(MOE, seed=3)
    experts = model.layers[1].mlp.experts
    name = "layers.1.mlp.experts.gate_proj"
    assert experts.gate_proj.shape == (MOE.n_experts, MOE.ffn_hidden, MOE.hidden)
    assert experts.down_proj.shape == (MOE.n_experts, MOE.hidden, MOE.ffn_hidden)
    assert torch.equal(reference_init(name, experts.gate_proj.shape, MOE, seed=3)[2:4], experts.gate_proj[2:4])
    assert not torch.equal(experts.gate_proj[0], experts.gate_proj[1])
    assert experts.down_proj.std() < 0.7 * experts.gate_proj.std()
    groups = build_optimizer(model, 1e-3).param_groups
    decayed = {id(p) for group in groups if group["weight_decay"] for p in group["params"]}
    assert all(id(p) in decayed for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    # The router bias is a buffer: no optimizer ever moves it.
    assert "layers.1.mlp.router_bias" not in dict(model.named_parameters())


@pytest.mark.parametrize("cfg", [TINY, get_config("tiny-moe"), replace(TINY, n_kv_heads=4, vocab_size=300),
                                 replace(MOE, n_shared_experts=2, experts_per_token=1)])
def test_parameter_count_formula(cfg):
    model = GPT(cfg)
    counts = count_parameters(cfg)
    params = dict(model.named_parameters())
    assert counts["total"] == sum(p.numel() for p in params.values())
    assert counts["embedding"] == model.tok_embeddings.weight.numel()
    assert counts["experts"] == sum(p.numel() for name, p in params.items() if ".experts." in name)
    # Active: every matrix but the embedding, with only k of each layer's E routed experts.
    unused_experts = sum(p[cfg.experts_per_token:].numel() for name, p in params.items() if ".experts." in name)
    matrices = sum(p.numel() for name, p in params.items() if not name.endswith("norm.weight"))
    assert counts["matmul_active"] == matrices - counts["embedding"] - unused_experts


def test_parameter_count_of_real_shapes():
    # The 8b preset has the shape of Llama 3 8B, published as 8.03e9 parameters.
    assert count_parameters(PRESETS["8b"])["total"] == pytest.approx(8.03e9, rel=0.002)
    assert count_parameters(PRESETS["1b"])["total"] == pytest.approx(1.50e9, rel=0.01)  # untied head


def test_mixtral_8x7b_counts_match_the_published_figures():
    """Mixtral-8x7B: 46.7e9 parameters, 12.9e9 active per token (the published figure includes the
    embedding); a training token then costs 6 FLOPs per active matmul parameter plus attention."""
    cfg = PRESETS["mixtral-8x7b"]
    counts = count_parameters(cfg)
    assert round(counts["total"] / 1e9, 1) == 46.7
    assert round((counts["matmul_active"] + counts["embedding"]) / 1e9, 1) == 12.9
    attention = 12 * cfg.n_layers * cfg.seq_len * cfg.hidden
    assert round((flops_per_token(cfg, cfg.seq_len) - attention) / 6 / 1e9, 2) == 12.75  # 12.9e9 less the embedding


@pytest.mark.parametrize("cfg", [TINY, get_config("tiny-moe"), replace(MOE, n_shared_experts=1, router="sigmoid"),
                                 replace(MOE, capacity_factor=0.5, aux_loss_coef=0.1, z_loss_coef=0.1)])
def test_flops_formula_equals_counted_flops(cfg):
    """6N + 12 L s h per token equals the matmul FLOPs torch counts in forward + backward, less the
    chunked loss's recomputation of the head.

    The attention core is swapped for the explicit formula because FlopCounterMode does not count
    the fused CPU attention kernel; the explicit one is plain matmuls. The looped experts are plain
    matmuls too, one per expert on the tokens that chose it, so they add up to k experts per token;
    in capacity mode each dropped choice (counted through the expert_compute seam) saves one
    expert's 6 * 3 h f.
    """
    model = GPT(cfg, seed=0)
    for layer in model.layers:
        layer.attn.attention_core = explicit_attention
    dropped = []

    def counting_dropped(tokens, routing, experts):
        dropped.append(int((~routing.kept).sum()))
        return looped_expert_compute(tokens, routing, experts)

    for layer in moe_layers(model):
        layer.expert_compute = counting_dropped
    batch, seq = 2, 32
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens).backward()
    saved = 6 * 3 * cfg.hidden * cfg.ffn_hidden * sum(dropped)
    assert (sum(dropped) > 0) == (cfg.capacity_factor is not None)
    # The chunked loss computes the head's forward matmul again in backward (LinearCrossEntropy's
    # price), 2 h V FLOPs per token that the model's formula leaves out, as MFU does.
    recomputed_head = 2 * cfg.hidden * cfg.vocab_size * batch * seq
    assert counter.get_total_flops() == flops_per_token(cfg, seq) * batch * seq - saved + recomputed_head


# ----------------------------------------------------------------------------- mixture of experts


def moe_layer(seed=0, **overrides) -> MixtureOfExperts:
    """Layer 0's MoE of a two-layer tiny-moe GPT: reference-initialised, options overridden."""
    return GPT(replace(MOE, **overrides), seed=seed).layers[0].mlp


def random_tokens(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def explicit_swiglu(x, gate, up, down):
    """SwiGLU written out with weight matrices laid out like nn.Linear's."""
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def explicit_moe_output(moe, tokens, routing):
    """sum over each token's kept choices of weight * expert(token), one token and one choice at a time,
    each expert an nn.Linear-built SwiGLU module holding that expert's slices of the stacked weights."""
    experts = moe.experts
    modules = []
    for e in range(moe.n_experts):
        module = SwiGLU(tokens.shape[1], experts.gate_proj.shape[1])
        with torch.no_grad():
            module.gate_proj.weight.copy_(experts.gate_proj[e])
            module.up_proj.weight.copy_(experts.up_proj[e])
            module.down_proj.weight.copy_(experts.down_proj[e])
        modules.append(module)
    rows = []
    for i in range(tokens.shape[0]):
        row = torch.zeros(tokens.shape[1])
        for e, w, kept in zip(routing.expert_ids[i].tolist(), routing.weights[i], routing.kept[i].tolist()):
            if kept:
                row = row + w * modules[e](tokens[i])
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("overrides", [{}, {"capacity_factor": 0.5}])
def test_stacked_experts_equal_explicit_per_expert_swiglu(overrides):
    """The layer's output is the weighted sum of its choices' SwiGLU outputs (capacity mode: of the kept
    choices only), and every expert weight receives a gradient, zeros for an expert no token chose."""
    moe = moe_layer(**overrides)
    x = random_tokens(2, 8, MOE.hidden)
    tokens = x.reshape(-1, MOE.hidden)
    routing = moe.route(tokens, seq_len=8)
    out = moe(x)
    torch.testing.assert_close(out.reshape(-1, MOE.hidden), explicit_moe_output(moe, tokens, routing))
    assert bool((~routing.kept).any()) == ("capacity_factor" in overrides)
    out.sum().backward()
    assert all(p.grad is not None for p in moe.parameters())


def test_softmax_router_renormalises_the_chosen_probabilities():
    moe = moe_layer()
    tokens = random_tokens(10, MOE.hidden)
    logits = tokens @ moe.router.weight.detach().T
    probs = logits.softmax(-1)
    for bias in (torch.zeros(MOE.n_experts), torch.tensor([0.0, 0.0, 0.0, 1.0])):
        moe.router_bias.copy_(bias)
        with torch.no_grad():
            routing = moe.route(tokens, seq_len=5)
        expected_ids = (probs + bias).argsort(-1, descending=True)[:, :MOE.experts_per_token]
        chosen = probs.gather(-1, expected_ids)
        assert torch.equal(routing.expert_ids, expected_ids)
        torch.testing.assert_close(routing.weights, chosen / chosen.sum(-1, keepdim=True))
        torch.testing.assert_close(routing.scores, probs)
        torch.testing.assert_close(routing.router_logits, logits)
        assert routing.kept.all()
    assert (routing.expert_ids[:, 0] == 3).all()  # the bias of 1 decides the top-1 choice
    # The router runs in float32 under bf16 autocast: the choice never sees bf16 rounding.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing_bf16 = moe.route(tokens, seq_len=5)
    assert routing_bf16.router_logits.dtype == torch.float32
    torch.testing.assert_close(routing_bf16.router_logits, logits)


def test_sigmoid_router_bias_changes_the_choice_not_the_weights():
    """DeepSeek-V3: s = sigmoid(logits); the bias takes part in choosing the experts only, the weights are
    the chosen s normalised to sum 1, and the aux loss's scores are s / sum_j s_j."""
    moe = moe_layer(router="sigmoid")
    tokens = random_tokens(12, MOE.hidden, seed=1)
    s = (tokens @ moe.router.weight.detach().T).sigmoid()
    unbiased = moe.route(tokens, seq_len=12)
    assert torch.equal(unbiased.expert_ids, s.argsort(-1, descending=True)[:, :2])
    least_liked = int(s.sum(0).argmin())
    moe.router_bias[least_liked] = 1.0   # more than any difference of two sigmoids
    biased = moe.route(tokens, seq_len=12)
    assert (biased.expert_ids[:, 0] == least_liked).all()
    assert not torch.equal(biased.expert_ids, unbiased.expert_ids)
    for routing in (unbiased, biased):
        chosen = s.gather(-1, routing.expert_ids)
        torch.testing.assert_close(routing.weights, chosen / chosen.sum(-1, keepdim=True))
        torch.testing.assert_close(routing.scores, s / s.sum(-1, keepdim=True))


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_ties_go_to_the_lower_expert_index(router):
    moe = moe_layer(router=router)
    with torch.no_grad():
        moe.router.weight.zero_()                          # every logit 0: all experts tie
        assert torch.equal(moe.route(random_tokens(6, MOE.hidden), 6).expert_ids, torch.tensor([[0, 1]] * 6))
        # Logits c_e * x_0 with c = (1, 2, 2, 1): experts 1 and 2 tie at the top when x_0 > 0,
        # experts 0 and 3 when x_0 < 0.
        moe.router.weight[:, 0] = torch.tensor([1.0, 2.0, 2.0, 1.0])
        tokens = torch.zeros(2, MOE.hidden)
        tokens[:, 0] = torch.tensor([1.0, -1.0])
        assert torch.equal(moe.route(tokens, 2).expert_ids, torch.tensor([[1, 2], [0, 3]]))


def test_capacity_drops_exactly_what_the_rule_says():
    """Capacity 2 per expert per sequence; slots go to every token's top-1 choice in position order, then
    to the top-2 choices. Worked by hand for one sequence (E = 3, T = 6):

        token:           0       1       2       3       4       5
        choices:        (0,1)   (0,2)   (0,1)   (1,0)   (2,1)   (1,2)
        top-1 pass:     0 ok    0 ok    0 full  1 ok    2 ok    1 ok      -> loads 2, 2, 1
        top-2 pass:     1 full  2 ok    1 full  0 full  1 full  2 full

    Token-major order would have kept token 0's second choice and dropped token 3's first. The
    second sequence repeats the first: capacity is per sequence, so it drops exactly the same.
    """
    one_sequence = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [2, 1], [1, 2]])
    kept_one = torch.tensor([[1, 0], [1, 1], [0, 0], [1, 0], [1, 0], [1, 0]], dtype=torch.bool)
    kept = capacity_mask(torch.cat([one_sequence, one_sequence]), seq_len=6, n_experts=3, capacity=2)
    assert torch.equal(kept, torch.cat([kept_one, kept_one]))
    assert expert_capacity(0.5, 2, 6, 3) == 2       # ceil(F k T / E) = ceil(2.0)
    assert expert_capacity(1.25, 2, 5, 4) == 4      # ceil(3.125)


def test_capacity_keeps_weights_unrenormalised():
    """A dropped choice weighs 0; the kept ones keep the weights the dropless router gives them."""
    capped, dropless = moe_layer(capacity_factor=0.5), moe_layer()
    tokens = random_tokens(16, MOE.hidden, seed=2)
    a, b = capped.route(tokens, seq_len=8), dropless.route(tokens, seq_len=8)
    assert torch.equal(a.expert_ids, b.expert_ids)
    assert torch.equal(a.kept, capacity_mask(a.expert_ids, 8, MOE.n_experts, expert_capacity(0.5, 2, 8, 4)))
    assert torch.equal(a.weights, b.weights * a.kept)
    partly_kept = a.kept.sum(-1) == 1
    assert partly_kept.any() and (a.weights.sum(-1)[partly_kept] < 1).all()


def test_shared_expert_adds_a_dense_swiglu_of_every_token():
    moe = moe_layer(n_shared_experts=2)
    shared = moe.shared_expert
    assert shared.gate_proj.weight.shape == (2 * MOE.ffn_hidden, MOE.hidden)
    x = random_tokens(2, 6, MOE.hidden, seed=3)
    with torch.no_grad():
        out = moe(x)
        moe.shared_expert = None
        routed_only = moe(x)
    expected = explicit_swiglu(x, shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    torch.testing.assert_close(out - routed_only, expected)


def direct_balancing_loss(kind, moe, x):
    """DeepSeek-V3's sequence-wise aux loss or ST-MoE's z-loss of tokens x [b, T, h], written out
    sequence by sequence and expert by expert: differentiable in the router weight."""
    b, T, _ = x.shape
    E, k = moe.n_experts, moe.experts_per_token
    logits = x @ moe.router.weight.T
    if kind == "z":
        return moe.z_loss_coef * logits.logsumexp(-1).square().mean()
    if moe.router_kind == "softmax":
        affinity = scores = logits.softmax(-1)
    else:
        affinity = logits.sigmoid()
        scores = affinity / affinity.sum(-1, keepdim=True)
    chosen = affinity.topk(k, dim=-1).indices         # random data: no ties
    total = 0.0
    for seq in range(b):
        for i in range(E):
            f_i = E / (k * T) * (chosen[seq] == i).sum()
            p_i = scores[seq, :, i].mean()
            total = total + f_i * p_i
    return moe.aux_loss_coef * total / b


@pytest.mark.parametrize("kind, overrides", [("aux", {"aux_loss_coef": 0.1}),
                                             ("aux", {"aux_loss_coef": 0.1, "router": "sigmoid"}),
                                             ("aux", {"aux_loss_coef": 0.1, "capacity_factor": 0.5}),
                                             ("z", {"z_loss_coef": 0.01})])
def test_balancing_loss_is_the_formula_and_reaches_the_router_through_backward(kind, overrides):
    """The layer's balancing loss equals the formula written out (in capacity mode too: f counts the
    router's choices, dropped or not); GPT.forward still returns the bare cross-entropy, yet backward
    adds the loss's gradient: the last layer's router gradient exceeds the one of the same model
    without the loss by exactly d(loss)/d(router weight)."""
    cfg = replace(MOE, **overrides)
    with_loss, without = GPT(cfg, seed=4), GPT(replace(cfg, aux_loss_coef=0.0, z_loss_coef=0.0), seed=4)
    layer_inputs = []
    with_loss.layers[-1].mlp.register_forward_pre_hook(lambda module, args: layer_inputs.append(args[0].detach()))
    tokens = torch.randint(0, MOE.vocab_size, (3, 10), generator=torch.Generator().manual_seed(4))
    loss = with_loss(tokens, tokens)
    assert torch.equal(loss, without(tokens, tokens))
    loss.backward()
    without(tokens, tokens).backward()
    last = with_loss.layers[-1].mlp
    direct = direct_balancing_loss(kind, last, layer_inputs[0])
    measured = last.last_aux_loss if kind == "aux" else last.last_z_loss
    torch.testing.assert_close(measured, direct.detach())
    assert measured > 0 and (last.last_z_loss if kind == "aux" else last.last_aux_loss) == 0
    (expected_extra,) = torch.autograd.grad(direct, last.router.weight)
    extra = last.router.weight.grad - without.layers[-1].mlp.router.weight.grad
    torch.testing.assert_close(extra, expected_extra, rtol=1e-4, atol=1e-7)
    # The first layer's loss reaches its router through the later layers' backward as well.
    first_extra = with_loss.layers[0].mlp.router.weight.grad - without.layers[0].mlp.router.weight.grad
    assert first_extra.abs().max() > 1e-3 * expected_extra.abs().max()


def test_sequences_per_step_makes_parts_add_up_to_the_whole_batch():
    """Two half-batches, each told the step has 4 sequences, give the router the same balancing gradient
    (and the same summed loss read-outs) as the whole batch at once; left at None they double it."""
    moe = moe_layer(aux_loss_coef=0.1, z_loss_coef=0.01)
    x = random_tokens(4, 8, MOE.hidden, seed=5)

    def balancing_gradient(parts, sequences_per_step):
        moe.zero_grad()
        moe.batch_share = BatchShare(sequences_per_step=sequences_per_step)
        read_outs = 0.0
        for part in parts:
            (moe(part) * 0).sum().backward()     # y's own gradient is zero: only the attached losses remain
            read_outs += moe.last_aux_loss + moe.last_z_loss
        return moe.router.weight.grad.clone(), read_outs

    whole, whole_loss = balancing_gradient([x], None)
    halves, halves_loss = balancing_gradient([x[:2], x[2:]], 4)
    torch.testing.assert_close(halves, whole)
    torch.testing.assert_close(halves_loss, whole_loss)
    unnormalised, _ = balancing_gradient([x[:2], x[2:]], None)
    torch.testing.assert_close(unnormalised, 2 * whole)


def test_sequence_shards_make_chunks_add_up_to_the_whole_sequences():
    """Context parallelism's seam: every sequence cut into two chunks, the layer told each sequence
    has 2 shards and handed the whole sequences' choice counts (its chunk's plus the other's, as a
    cp all-reduce would sum them), gives the router the balancing gradient and the loss read-outs
    of the whole sequences at once; without the seam, the chunks' aux loss is another one."""
    moe = moe_layer(aux_loss_coef=0.1, z_loss_coef=0.01)
    x = random_tokens(2, 8, MOE.hidden, seed=8)
    chunks = (x[:, :4], x[:, 4:])
    with torch.no_grad():
        counts = [choice_counts(moe.route(chunk.reshape(-1, MOE.hidden), 4).expert_ids.view(2, 4, -1), MOE.n_experts)
                  for chunk in chunks]

    def balancing(parts, shards, completions):
        moe.zero_grad()
        read_outs = 0.0
        for part, complete in zip(parts, completions):
            moe.batch_share = BatchShare(sequence_shards=shards, whole_sequence_counts=complete)
            (moe(part) * 0).sum().backward()     # only the attached losses reach the router
            read_outs += moe.last_aux_loss + moe.last_z_loss
        return moe.router.weight.grad.clone(), read_outs

    whole = balancing([x], 1, [lambda c: c])
    sharded = balancing(chunks, 2, [lambda c: c + counts[1], lambda c: c + counts[0]])
    for ours, theirs in zip(sharded, whole):
        torch.testing.assert_close(ours, theirs)
    chunks_alone = balancing(chunks, 1, [lambda c: c, lambda c: c])
    assert not torch.allclose(chunks_alone[1], whole[1])


def test_router_bias_moves_by_rate_times_sign_of_mean_minus_load():
    """expert_load counts every choice, dropped or kept, over forwards; update_router_bias moves each
    bias by rate * sign(mean - load) and starts a new count."""
    moe = moe_layer(capacity_factor=0.5)
    xs = [random_tokens(2, 8, MOE.hidden, seed=s) for s in (6, 7)]
    with torch.no_grad():
        ids = [moe.route(x.reshape(-1, MOE.hidden), 8).expert_ids for x in xs]
        for x in xs:
            moe(x)
    assert torch.equal(moe.expert_load, torch.bincount(torch.cat(ids).flatten(), minlength=4).float())
    moe.update_router_bias(0.01, torch.tensor([5.0, 1.0, 3.0, 3.0]))
    assert torch.equal(moe.router_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert not moe.expert_load.any()
    moe.update_router_bias(0.01, torch.tensor([5, 1, 4, 2]))
    torch.testing.assert_close(moe.router_bias, torch.tensor([-0.02, 0.02, -0.01, 0.01]))


@pytest.mark.parametrize("overrides, message", [
    ({"n_experts": -1}, "n_experts=-1 must be 0 (dense) or more"),
    ({"n_experts": 4, "experts_per_token": 5}, "experts_per_token=5 must be in 1..n_experts=4"),
    ({"n_experts": 4, "router": "top1"}, "router='top1' must be 'softmax' or 'sigmoid'"),
    ({"n_experts": 4, "n_shared_experts": -1}, "n_shared_experts=-1 must be 0 or more"),
    ({"n_experts": 4, "capacity_factor": 0.0}, "capacity_factor=0.0 must be a positive number"),
    ({"n_experts": 4, "capacity_factor": float("inf")}, "capacity_factor=inf must be a positive number"),
    ({"n_experts": 4, "aux_loss_coef": -0.1}, "aux_loss_coef=-0.1 must be 0 (off) or a positive number"),
    ({"n_experts": 4, "z_loss_coef": float("nan")}, "z_loss_coef=nan must be 0 (off) or a positive number"),
    ({"n_experts": 4, "router": "sigmoid", "z_loss_coef": 1e-3}, "z_loss_coef=0.001 applies to the softmax router"),
    ({"router": "sigmoid"}, "router='sigmoid' needs a mixture-of-experts model"),
    ({"n_shared_experts": 1}, "n_shared_experts=1 needs a mixture-of-experts model"),
    ({"capacity_factor": 1.25}, "capacity_factor=1.25 needs a mixture-of-experts model"),
    ({"aux_loss_coef": 0.01}, "aux_loss_coef=0.01 needs a mixture-of-experts model"),
    ({"z_loss_coef": 0.01}, "z_loss_coef=0.01 needs a mixture-of-experts model"),
])
def test_bad_moe_config_is_one_clear_error(overrides, message):
    with pytest.raises(ValueError) as error:
        GPTConfig(**overrides)
    assert message in str(error.value)
    assert "; " not in str(error.value)   # one problem, one message


def test_bad_config_is_one_clear_error():
    with pytest.raises(ValueError, match="n_heads=4 is not divisible by n_kv_heads=3"):
        GPTConfig(n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        get_config("huge")
