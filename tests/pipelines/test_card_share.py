"""`tune.resources_per_trial.gpu: auto`'s rule: shares from the plans' peaks and reserves, capped at
max_concurrent_trials, a whole card for a trial too big to share, and a refusal with the plan's numbers for one too
big for the card."""

from __future__ import annotations

import pytest

from pipelines.errors import UserError
from pipelines.trials.card_share import card_share, card_shares

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
