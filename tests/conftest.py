import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from intra-op threads and lose several-fold (thread-pool
    round trips) when other jobs share the 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
