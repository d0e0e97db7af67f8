"""``uninstall_global`` undoes exactly what ``install_global`` did (the ``VMALLOC_WINDOW``
autoload): called while a user's ``with scheduler.swap()`` is open, it closed the user's
context (whatever SwapContext was on top of the saved-tensor hooks) and left the global one
swapping. It refuses now, changing nothing, and works once the user's context has exited."""
import pytest
import torch

import scheduler
from scheduler.runtime import swap as swap_mod


def test_uninstall_global_inside_a_user_context_refuses_and_changes_nothing():
    g = swap_mod.install_global(4096)
    try:
        with scheduler.swap(window=1, device="cpu") as user:
            assert swap_mod.global_context() is g  # not the user's, on top
            assert swap_mod.install_global(4096) is g
            with pytest.raises(RuntimeError, match="not the innermost.*saved-tensor hooks"):
                swap_mod.uninstall_global()
            assert user._hooks is not None and g._hooks is not None
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        assert top is not None and getattr(top[0], "__self__", None) is g
    finally:
        assert swap_mod.uninstall_global() is g
    assert swap_mod.global_context() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    x = torch.randn(64, 64, requires_grad=True)
    (x.exp() * 2).sum().backward()
    assert g.stats()["iterations"] == 0  # off for good
    assert swap_mod.uninstall_global() is None
    from vmalloc.pluggable import live_report
    live_report.remove_section("swap")


def test_a_user_context_alone_is_not_the_global_one():
    with scheduler.swap(window=1, device="cpu") as user:
        assert swap_mod.global_context() is None
        assert swap_mod.uninstall_global() is None
        assert user._hooks is not None
        # installed on top, its hooks would be the ones the user's exit pops
        with pytest.raises(RuntimeError, match="already on"):
            swap_mod.install_global(1)
        assert swap_mod.global_context() is None
