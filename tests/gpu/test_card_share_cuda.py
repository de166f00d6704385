"""A packed trial's share of the card, enforced by CUDA's caching allocator (`gpu: auto`, issue 60): an allocation
over the process's memory fraction fails with torch's out-of-memory while one under it succeeds, and a packed trial's
out-of-memory names its plan. Run with `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import pytest
import torch

from pipelines.errors import UserError
from pipelines.trials.card_share import card_share, enforced_share, memory_cap
from tests.conftest import tiny_params

pytestmark = pytest.mark.gpu
MIB = 2**20


@pytest.fixture
def uncapped():
    """The process's allocator without a cap before and after: other tests in this process allocate freely."""
    torch.cuda.empty_cache()
    yield torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
    torch.cuda.empty_cache()


def test_an_allocation_over_the_fraction_fails_and_one_under_it_succeeds(uncapped):
    total = torch.cuda.get_device_properties(uncapped).total_memory
    torch.cuda.set_per_process_memory_fraction(0.05, uncapped)
    cap = int(0.05 * total)
    room = cap - torch.cuda.memory_reserved(uncapped)  # what this process's allocator already holds counts
    under = torch.empty(room // 2, dtype=torch.uint8, device="cuda")
    assert under.numel() == room // 2
    del under
    torch.cuda.empty_cache()
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(cap + 64 * MIB, dtype=torch.uint8, device="cuda")
    assert torch.empty(room // 2, dtype=torch.uint8, device="cuda").numel() == room // 2  # the cap, not the card


def test_a_packed_trial_is_capped_at_its_share_and_its_out_of_memory_names_its_plan(default_params, uncapped):
    total = torch.cuda.get_device_properties(uncapped).total_memory
    share = card_share("small", 1024 * MIB, 800 * MIB, "this card", total, cap=4)  # 1.8 GiB: four to any listed card
    assert share.sharing == 4
    cap = memory_cap(share, total)
    tags: dict[str, str] = {}
    with pytest.raises(UserError) as refused:
        with enforced_share(tiny_params(default_params, device="cuda"), share, "small", tags.update):
            planned = torch.empty(share.peak_bytes, dtype=torch.uint8, device="cuda")  # its plan fits its cap
            del planned
            torch.empty(total // 4, dtype=torch.uint8, device="cuda")  # a quarter of the card: over the cap
    assert tags == {"card.memory_fraction": f"{cap.fraction:.4g}"}
    assert isinstance(refused.value.__cause__, torch.OutOfMemoryError)
    message = str(refused.value)
    assert "variant 'small' ran out of memory in its share of the card: 4 trials to a card" in message
    assert f"its allocator capped at {cap.cap_bytes / MIB:,.1f} MiB" in message and "peak was 1,024.0 MiB" in message
