"""The data-parallel all-reduce in buckets: gradients lie in the buckets (no copy), and a
bucket starts as soon as the last backward has produced all of its gradients."""
import torch
import torch.distributed as dist

from runtime.groups import GradientBuckets


def _layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])


def _backward(model, i):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(i))
    model(x).square().sum().backward()


def test_buckets_start_during_the_last_backward_and_hold_the_gradients():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = _layers()
        params = list(model.parameters())
        buckets = GradientBuckets(params, dist.group.WORLD, bucket_bytes=32 * 32 * 4)  # about a layer each
        assert len(buckets.buckets) >= 4
        started = []
        # the first layer's gradients come last in backward: when its hook runs, the others' buckets are out
        params[0].register_post_accumulate_grad_hook(lambda p: started.append(sum(w is not None for w in buckets.works)))
        for step in range(2):
            buckets.begin_step()
            for i in range(3):  # micro-batches: only the last backward completes the buckets
                if i == 2:
                    buckets.arm(params)
                _backward(model, i)
            assert started[-1] >= len(buckets.buckets) - 1 and started[:2] == [0, 0]
            buckets.finish()
            started.clear()
        # the gradients lie in the buckets and hold the sum over the micro-batches (a world of 1)
        expected = _layers()
        for i in range(3):
            _backward(expected, i)
        for p, q in zip(params, expected.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-5)
            assert any(p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                       for flat in buckets.buckets)
    finally:
        dist.destroy_process_group()
