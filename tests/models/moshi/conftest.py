import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny convs run fastest on one thread, and a loaded 2-core machine stalls two (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
