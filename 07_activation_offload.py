"""
Lesson 07's activation offload: the tensors chosen blocks keep for backward wait in host memory,
not on the device, between their forward and their backward (--offload activations).

    torchrun --nproc_per_node=4 07_full_5d.py --dp 2 --tp 2 --offload activations
    torchrun --nproc_per_node=4 07_full_5d.py --pp 2 --dp 2 --recompute full --offload activations
    python 07_full_5d.py --plan --preset 8b --gpus 8 --gpu H100 --seq-len 8192 --micro-batch-size 1 \
        --grad-accum 8 --pp 4 --dp 2 --offload activations

The problem. Backward needs what forward computed: with the 8b preset, 8192 tokens per sequence
and one sequence per micro-batch, each block keeps about 1.9 GB in bf16 (lesson 07's docstring
derives the bytes), and 1F1B's first stage keeps pp micro-batches of its blocks at once. On 8 H100s
as pp 4 x dp 2 (ZeRO-1, 8 micro-batches) that stage keeps 55 GiB of activations, 81.5 GiB in all,
over the 72 GiB planned of 80 (--plan, below). Recomputation pays for the memory with compute,
parallelism with more devices; the third way pays with the host link, while a node's 2 TB of host
memory idles.

The idea (Megatron-LM's fine-grained activation offloading, DeepSpeed's CPU checkpointing): during
forward every tensor a chosen block saves for backward goes to pinned host memory, copied on a side
stream while the compute stream goes on; the device copy is freed once copied. In backward, when
block i+1's output gradient arrives (its backward is about to start), block i's tensors start
coming back on a second side stream, so the fetch hides behind block i+1's backward:

    forward   compute [blk 0 F][blk 1 F][blk 2 F][blk 3 F]  (blk 3: the chunk's last, kept)
              out         [0 -> host][1 -> host][2 -> host]
    backward  compute                  [blk 3 B][blk 2 B][blk 1 B][blk 0 B]
              back              fetch 2 ^[2 <- host]
                                        fetch 1 ^[1 <- host]
                                                 fetch 0 ^[0 <- host]

Each micro-batch's tensors are its own: 1F1B runs several forwards before their backwards, and
block i's tensors of micro-batch m are fetched from block i+1's backward of the same micro-batch
(a hook on that block's output, registered at its forward, as lesson 06's ZeRO-3 gathers ahead).
By default each chunk's last block keeps its tensors: its backward follows its forward at once
(only the head or the next stage in between), so its copies would have nothing to hide behind.

What is never moved: a parameter or a view of one (ZeRO-3 frees and gathers its weights itself)
and a pipeline stage's received input (the schedule keeps it for its gradient anyway): any leaf
that requires a gradient stays as it is. Everything else a block saves moves, whoever saved it:
autograd's own ops, lesson 04's ring attention, 05's experts, 07_fp8's FP8 copies of the inputs
(their weights are parameters: they stay). Under --recompute full a block saves only its input
(and the rotary tables), so that is what moves: the two compose into a block that keeps nothing on
the device; under selective, what selective keeps.

The price. Host-link bytes per step: the offloaded blocks' kept bytes of every micro-batch, out
and back (07_memory_plan prints the bandwidth that needs at the estimated step time next to the
link's: ~51 GB/s per direction over an H100's PCIe Gen5 x16, ~450 GB/s over a GH200's C2C).
It stalls when a block's copy takes longer than the compute it hides behind, the next block's
forward (out) or backward (back). In the layout above a block's 1.9 GB takes ~36 ms over PCIe,
several times its forward: the offload fits it in 35.1 GiB, but the plan's step grows from 3.1 s
to 5.6 s, and the plan ranks full recomputation first. Under full recomputation a block keeps its
input, 8192 x 4096 x 2 bytes = 67 MB, which the link moves in 1.3 ms. Host memory: the offloaded
bytes of every micro-batch in flight, on each rank of the node (48 GiB per rank above).

Safety of the overlap on CUDA (the caching allocator reuses freed memory in the order of the
stream that freed it):
  out   the out stream waits for the compute stream (the tensor is computed), copies, and the
        device tensor is recorded as used by the out stream (record_stream): when forward drops
        it, the allocator hands its memory to new compute-stream tensors only once the copy is
        done. Before block i+1's forward the compute stream waits for block i-1's copies: at most
        one block copies behind the compute, and a slow link stalls forward instead of filling
        the device with blocks waiting for their copy.
  back  the device buffers are allocated on the compute stream; the back stream waits for the
        compute stream (that memory may still be read by queued kernels of its previous tensor)
        and for the block's copies out, copies, records an event; the compute stream waits for
        the event before backward uses the tensors. The pinned host copies are dropped once the
        copy back is queued: PyTorch's host allocator records the copy's event and reuses the
        memory only after it.
On the CPU (gloo) "host" and "device" are the same memory: each copy is a real, separate tensor,
made at once, and the original is released: the tests measure the device-side bytes falling.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch

# ============================================================================ the technique: what stays on the device


def keeps_on_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """What stays: a leaf that requires a gradient or a view of one (parameters, which ZeRO-3 frees and
    gathers itself, and a pipeline stage's received input, which the schedule keeps for its gradient),
    a tensor not on the device, and anything not a plain strided tensor."""
    base = tensor if tensor._base is None else tensor._base
    return ((base.is_leaf and base.requires_grad) or tensor.device.type != device.type
            or tensor.layout != torch.strided or type(tensor) is not torch.Tensor)


# ============================================================================ the technique: out, and back ahead


class BlockOnHost:
    """One block's saved tensors of one micro-batch: the storages they view, in host memory from the
    block's forward until they are fetched back for its backward. Views of one storage share it
    (a linear keeps its input flattened, the norm the same tensor whole)."""

    def __init__(self):
        self.storages: list = []        # weak references to the device storages, to find a storage again
        self.on_host: list[torch.Tensor] = []
        self.on_device: list[torch.Tensor] | None = None
        self.copied = None              # CUDA: the event after its copies out
        self.ready = None               # CUDA: the event after its copies back

    def index_of(self, storage) -> int | None:
        for index, known in enumerate(self.storages):
            if known() is storage:
                return index
        return None


class SavedOnHost:
    """What autograd holds in place of a moved tensor: its block's record, which storage, and the view."""

    __slots__ = ("block", "index", "dtype", "offset", "size", "stride")

    def __init__(self, block: BlockOnHost, index: int, tensor: torch.Tensor):
        self.block, self.index = block, index
        self.dtype, self.offset, self.size, self.stride = (tensor.dtype, tensor.storage_offset(), tensor.size(),
                                                           tensor.stride())


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage a tensor views, as a flat uint8 tensor (the bytes a copy moves)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


class ActivationOffload:
    """The chosen blocks of one chunk (lesson 03: a stage, or one of an interleaved rank's chunks; the
    whole model without a pipeline): their saved tensors to the host during forward, back from the
    next block's backward pre-hook. `streams`: on CUDA the side streams out and back (one per
    direction of the host link, which carries both at once; shared by a rank's chunks), None on the
    CPU, where every copy is made at once."""

    def __init__(self, blocks, offloaded: int, device: torch.device, streams: tuple | None = None):
        self.device = device
        self.out_stream, self.back_stream = streams or (None, None)
        self.current: BlockOnHost | None = None       # the block whose forward is running, if offloaded
        # block index -> its record of the latest forward, weakly: the saved tensors' handles own it
        self.latest: dict[int, weakref.ref] = {}
        for index, block in enumerate(blocks):
            if index < offloaded:
                block.register_forward_pre_hook(partial(self.before_forward, index))
                block.register_forward_hook(partial(self.after_forward, index), always_call=True)
            if 0 < index <= offloaded:
                block.register_forward_hook(partial(self.fetch_ahead, index))

    # ---------------------------------------------------------------- forward: out to the host

    def before_forward(self, index: int, block, args) -> None:
        if torch.is_grad_enabled():
            # At most the block before this one still copying out: where the link is slower than the
            # compute, forward waits here rather than the device filling up with blocks to copy.
            two_before = self.latest.get(index - 2)
            two_before = two_before() if two_before is not None else None
            if two_before is not None and two_before.copied is not None:
                torch.cuda.current_stream(self.device).wait_event(two_before.copied)
            self.current = BlockOnHost()
            self.latest[index] = weakref.ref(self.current)
            self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.hooks.__enter__()

    def after_forward(self, index: int, block, args, output) -> None:
        if self.current is not None:
            self.hooks.__exit__(None, None, None)
            if self.out_stream is not None:
                self.current.copied = torch.cuda.Event()
                self.current.copied.record(self.out_stream)
            self.current = None

    def pack(self, tensor: torch.Tensor):
        if keeps_on_device(tensor, self.device):
            return tensor
        block, storage = self.current, tensor.untyped_storage()
        index = block.index_of(storage)
        if index is None:
            index = len(block.on_host)
            block.storages.append(weakref.ref(storage))
            block.on_host.append(self.to_host(storage_bytes(tensor)))
        return SavedOnHost(block, index, tensor)

    def to_host(self, device_bytes: torch.Tensor) -> torch.Tensor:
        if self.out_stream is None:
            return device_bytes.clone()
        host = torch.empty(device_bytes.shape, dtype=torch.uint8, pin_memory=True)
        self.out_stream.wait_stream(torch.cuda.current_stream(self.device))     # the tensor is computed
        with torch.cuda.stream(self.out_stream):
            host.copy_(device_bytes, non_blocking=True)
        device_bytes.record_stream(self.out_stream)     # its memory is not reused before the copy is done
        return host

    # ---------------------------------------------------------------- backward: back to the device

    def fetch_ahead(self, index: int, block, args, output) -> None:
        """At block `index`'s forward: when its output's gradient arrives, the block before it in this
        micro-batch starts coming back (a weak reference: a record no tensor needs any more is gone)."""
        ahead = self.latest.get(index - 1)
        if torch.is_grad_enabled() and ahead is not None and output.requires_grad:
            output.register_hook(lambda grad: self.fetch(ahead()))

    def fetch(self, block: BlockOnHost | None) -> None:
        if block is None or block.on_device is not None:
            return
        if self.back_stream is None:
            block.on_device = [host.clone() for host in block.on_host]
        else:
            compute = torch.cuda.current_stream(self.device)
            block.on_device = [torch.empty(host.shape, dtype=torch.uint8, device=self.device)
                               for host in block.on_host]
            self.back_stream.wait_stream(compute)       # the buffers' memory may still be read by queued kernels
            self.back_stream.wait_event(block.copied)   # and the host copies must be written
            with torch.cuda.stream(self.back_stream):
                for device_bytes, host in zip(block.on_device, block.on_host):
                    device_bytes.copy_(host, non_blocking=True)
                block.ready = torch.cuda.Event()
                block.ready.record()
        block.on_host = []

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        block = packed.block
        self.fetch(block)           # not fetched ahead (a chunk's last block, when every block is offloaded)
        if block.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(block.ready)
        storage = block.on_device[packed.index].untyped_storage()
        return torch.empty(0, dtype=packed.dtype, device=self.device).set_(storage, packed.offset, packed.size,
                                                                           packed.stride)


def offload_activations(chunks, chosen: int | None, device: torch.device) -> list[ActivationOffload]:
    """--offload activations: in each of this rank's chunks, its first blocks' saved tensors in host memory."""
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if device.type == "cuda" else None
    return [ActivationOffload(list(chunk.layers), offloaded_blocks(len(chunk.layers), chosen), device, streams)
            for chunk in chunks]


# ============================================================================ configuration rules


def offloaded_blocks(n_blocks: int, chosen: int | None) -> int:
    """--offload-blocks: the first `chosen` of a chunk's blocks (all, in a chunk with fewer); by default
    all but its last."""
    return max(n_blocks - 1, 0) if chosen is None else min(chosen, n_blocks)
