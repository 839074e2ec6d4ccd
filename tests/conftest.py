import pytest
import torch
import torch._dynamo


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts from a clean dynamo cache and a fixed seed."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
