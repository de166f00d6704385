"""`tune.resources_per_trial.gpu: auto`'s rule: shares from the plans' peaks and reserves, capped at
max_concurrent_trials, a whole card for a trial too big to share, and a refusal with the plan's numbers for one too
big for the card; a packed trial's allocator capped at its share, less its CUDA context, and its plan named when it runs
out of memory."""

from __future__ import annotations

import pytest

from pipelines.errors import UserError
from pipelines.trials.card_share import card_share, card_shares, enforced_share, memory_cap
from tests.conftest import tiny_params

GIB, MIB = 2**30, 2**20
H200 = 143_771 * MIB
RESERVE = 787 * MIB


def test_small_variants_share_a_card_as_their_plans_and_reserves_allow():
    # BERT-base's plan, about 3.6 GB: 4 to an H200 under a cap of 4, 8 under a cap of 8 (3.6 + 0.8 GB x 8 < 141 GB).
    share = card_share("bf16", int(3.6 * GIB), RESERVE, "H200", H200, cap=4)
    assert share.gpu == 0.25 and share.sharing == 4
    assert card_share("bf16", int(3.6 * GIB), RESERVE, "H200", H200, cap=8).sharing == 8
    # Without the cap the card holds 32 of them: peaks plus reserves, never more than the card.
    wide = card_share("bf16", int(3.6 * GIB), RESERVE, "H200", H200, cap=64)
    assert wide.sharing == 32 and wide.sharing * wide.need_bytes <= H200 < (wide.sharing + 1) * wide.need_bytes


def test_any_mix_of_shares_fits_the_card_together():
    planned = {"small": (2 * GIB, RESERVE), "middle": (30 * GIB, RESERVE), "large": (60 * GIB, RESERVE)}
    shares = card_shares(planned, "H200", H200, cap=4)
    assert [shares[v].sharing for v in planned] == [4, 4, 2]
    for name, share in shares.items():  # each share covers its need, so shares summing to 1 fit together
        assert share.gpu * H200 >= share.need_bytes, name


def test_a_trial_too_big_to_share_gets_a_whole_card():
    share = card_share("full", 80 * GIB, RESERVE, "H200", H200, cap=4)
    assert share.gpu == 1.0 and share.sharing == 1


def test_a_trial_too_big_for_the_card_is_refused_with_the_plans_numbers():
    with pytest.raises(UserError) as refused:
        card_share("8b-full", 150 * GIB, RESERVE, "H200", H200, cap=4)
    message = str(refused.value)
    assert "variant '8b-full' does not fit one H200" in message
    assert "153,600.0 MiB + the process's reserve 787.0 MiB = 154,387.0 MiB, over the card's 143,771.0 MiB" in message


def test_a_packed_trials_allocator_is_capped_at_its_share_less_its_cuda_context():
    share = card_share("bf16", int(3.6 * GIB), RESERVE, "H200", H200, cap=4)
    cap = memory_cap(share, H200)
    # By hand: a quarter of the H200's 143,771 MiB is 35,942.75 MiB, less the 800 MiB context reserve.
    assert cap.share_bytes == int(143_771 / 4 * MIB) and cap.cap_bytes == int((143_771 / 4 - 800) * MIB)
    assert cap.fraction == pytest.approx((143_771 / 4 - 800) / 143_771)
    assert cap.cap_bytes >= share.peak_bytes  # the plan fits its cap
    assert 4 * (cap.cap_bytes + 800 * MIB) <= H200  # four caps and their contexts fit the card together


def test_a_packed_trial_over_its_share_says_its_plan_and_what_to_do():
    share = card_share("bf16", int(3.6 * GIB), RESERVE, "H200", H200, cap=4)
    message = memory_cap(share, H200).exceeded("bf16", share)
    assert "variant 'bf16' ran out of memory in its share of the card: 4 trials to a card" in message
    assert "its share 35,942.8 MiB, its allocator capped at 35,142.8 MiB" in message
    assert "its plan's peak was 3,686.4 MiB, 4,473.4 MiB with the process's reserve" in message
    assert "lower tune.max_concurrent_trials" in message and "set tune.resources_per_trial.gpu: 1" in message


def test_a_share_is_enforced_on_cuda_only_and_only_when_packed(default_params):
    import torch

    packed = card_share("bf16", int(3.6 * GIB), RESERVE, "H200", H200, cap=4)
    alone = card_share("full", 80 * GIB, RESERVE, "H200", H200, cap=4)
    tags: dict[str, str] = {}
    with enforced_share(tiny_params(default_params, device="cpu"), packed, "bf16", tags.update):
        assert torch.empty(2**20).numel() == 2**20  # a CPU trial trains as before
    assert tags == {"card.memory_fraction": "none (trains on cpu)"}
    tags.clear()
    with enforced_share(tiny_params(default_params, device="cpu"), alone, "full", tags.update):
        pass
    assert tags == {}  # a card to itself: nothing to enforce


def test_packing_plans_compile_auto_as_compiled_with_its_cuda_graph_pool(default_params, tmp_path):
    from pipelines.prepare import prepare_dataset
    from pipelines.resolve.plan_report import plan_targets
    from pipelines.resolve.target import target_named
    from pipelines.trials.card_share import planned_shares

    # The trial decides compile: auto after its plan, so packing plans it as compiled: the conservative side.
    variants = {"auto": {}, "compiled": {"compile": True}, "eager": {"compile": False}}
    params = tiny_params(
        default_params, **{"data.generator.num_rows": 300, "tune.variants": variants, "compile": "auto"}
    )
    prepare_dataset(params, tmp_path, tmp_path / "tokenized")
    card = target_named("H100-80GB")
    shares = planned_shares(params, tmp_path, tmp_path / "tokenized", card)
    plans = plan_targets(params, tmp_path, tmp_path / "tokenized", [card], fastest=False)[card.name]  # as written
    compiled, eager = plans["compiled"].plan, plans["eager"].plan
    assert plans["auto"].plan.cuda_graph_pool == 0 and eager.cuda_graph_pool == 0 < compiled.cuda_graph_pool
    assert shares["auto"].peak_bytes == shares["compiled"].peak_bytes == compiled.peak
    assert shares["eager"].peak_bytes == eager.peak < compiled.peak
