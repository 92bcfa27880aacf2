"""lockstep.torch.Checkpointer: a program's model and optimizer state in its worker's memory.

    ckpt = lockstep.torch.Checkpointer()
    start_step = ckpt.load(model, optimizer) or 0     # after a restart: the group's newest step
    for step in range(start_step + 1, steps + 1):
        ...
        ckpt.save(step, model, optimizer, extra={"epoch": epoch})

save() copies every tensor of the state dicts (and the rest, pickled) into one of two slots
that the worker keeps for the job: files on the worker's tmpfs, mapped into this process, so
a save costs a memory copy and outlives the process. The slot's layout is the worker's
(worker/program/checkpoint_memory.h): a 4096-byte header whose commit sequence is written last,
then a safetensors payload. A save interrupted by the process's death leaves its slot
uncommitted, and the other slot (the previous save) is what is restored.

The worker watches the slots: it copies the newest save, in the background, to the member's
checkpoint peer (a worker on another host, chosen by the coordinator), so that a worker or a
host lost with its memory does not lose its saves, and, when the job asks, writes one save in
N to its checkpoint_dir.

load() asks the worker which state to restore: the members of the generation agree on the
newest step every one of them can obtain, and each takes it from its own worker's memory; a
member whose worker lost it (restarted) or that replaces a departed one finds it fetched from
the peer that kept a copy, before the program started. It fills the
model's tensors in place and loads the optimizer's state; `extra` comes back as
checkpointer.extra. Every rank of the group calls load() (before its first save).

Outside Lockstep, Checkpointer() raises, unless fallback_dir names a directory: then save()
and load() use torch.save / torch.load of DIR/checkpoint-rankN.pt (written atomically).
"""
import copyreg
import ctypes
import io
import json
import mmap
import operator
import os
import pickle
import struct
import threading
import time
from itertools import chain

import torch

from lockstep import _agent

MAGIC = b"LSCKPT01"
HEADER_BYTES = 4096
# The non-tensor remainder (param_groups, small values of `extra`) is pickled; larger values
# belong in tensors.
MAX_REMAINDER_BYTES = 64 << 20
_REMAINDER = "__lockstep_remainder__"
# save(blocking=False) of host tensors whose payload is at most this commits before it returns:
# its checksum costs less than handing it to a thread (measured: a 54 KB state, 0.08 ms
# inline against 0.4 ms through a thread).
INLINE_COMMIT_BYTES = 1 << 20

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


_CONTAINERS = (torch.Tensor, dict, list, tuple)
# What a tensor's place in the layout depends on (its device: how it is copied; sparse or not:
# a checkpoint holds only dense tensors, checked per layout).
_LAYOUT_OF = operator.attrgetter("dtype", "shape", "device", "is_sparse")
_DATA_PTR = torch.Tensor.data_ptr
_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")
_CONTIGUOUS = torch.Tensor.is_contiguous
# Tensors whose memory does not hold their values as they read (_host_sources).
_NEGATIVE = torch.Tensor.is_neg
_ZERO = getattr(torch.Tensor, "_is_zerotensor", lambda t: False)


class _Tensor:
    """What a tensor is pickled as in the remainder: _Tensor(name), the name of its entry in the
    safetensors header. Loading resolves it to the tensor (_Unpickler)."""

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return _Tensor, (self.name,)


def _load_gather():
    """lockstep_gather_xxh3 from liblockstep_checkpoint.so next to this module (python/native:
    the build tree's package has it), or None: a save then copies with torch.cat and hashes
    with the xxhash module, to the same bytes. LOCKSTEP_CHECKPOINT_NATIVE=0 turns it off."""
    if os.environ.get("LOCKSTEP_CHECKPOINT_NATIVE", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                       "liblockstep_checkpoint.so"))
    except OSError:
        return None
    gather = lib.lockstep_gather_xxh3
    gather.restype = ctypes.c_int
    gather.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_uint64, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)]
    return gather


_GATHER = _load_gather()


def _hash_payload(slot, length):
    """XXH3-64 of the first `length` bytes of the slot's payload (a save whose copy did not hash
    it: a non-blocking one, or one without the native copy): by the native library, a gather of
    nothing, when it is here; else by the xxhash module."""
    if _GATHER is not None:
        out = ctypes.c_uint64()
        if _GATHER(0, None, None, None, slot.base + HEADER_BYTES, length, out) != 0:
            raise RuntimeError("lockstep.torch.Checkpointer: no memory for the hash's state")
        return out.value
    try:
        import xxhash
    except ImportError:
        raise RuntimeError("lockstep.torch.Checkpointer needs the xxhash module "
                           "(Debian: python3-xxhash) where liblockstep_checkpoint.so is "
                           "not") from None
    return xxhash.xxh3_64_intdigest(slot.payload[:length])


_PLAIN_TENSOR = {torch.Tensor, torch.nn.Parameter}
_DICT = {dict}


class _Pickler(pickle.Pickler):
    """Pickles the state in one pass of the C pickler: every tensor it meets, in a state dict
    or inside any object, goes to `tensors` (after the tensors of the dicts that went as their
    keys) and is pickled as _Tensor(its index). A tensor met twice (tied weights) is stored
    once. A Checkpointer keeps one from save to save: making one costs about what a dump does."""

    def __init__(self):
        self._out = io.BytesIO()
        super().__init__(self._out, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = None
        self._index = None  # id(tensor) -> its index, made when a tensor is first met
        # A dispatch_table, not reducer_override: the C pickler asks it only about types it
        # does not pickle itself (a dict, list or tuple costs no Python call).
        self.dispatch_table = _Reductions(self._tensor)

    def pickle(self, obj, tensors):
        """`obj` pickled, as bytes; the tensors met appended to `tensors`. Not reentrant (the C
        pickler's buffer and memo are the object's): Checkpointer.save refuses a nested save."""
        if self.tensors is not None:
            raise RuntimeError("lockstep.torch.Checkpointer: a pickle inside a pickle")
        out = self._out
        out.seek(0)
        out.truncate()
        self.tensors = tensors
        try:
            self.dump(obj)
        finally:
            self.clear_memo()  # the memo holds the state's objects: not past the save
            self.tensors = self._index = None
        return out.getvalue()

    def _tensor(self, obj):
        tensors = self.tensors
        if self._index is None:
            self._index = {id(t): i for i, t in enumerate(tensors)}
        i = self._index.get(id(obj))
        if i is None:
            i = self._index[id(obj)] = len(tensors)
            tensors.append(obj)
        return _Tensor, (str(i),)


class _Reductions(dict):
    """_Pickler's dispatch_table: every tensor type (a subclass too, found when first met) to
    the tensor's reduction; any other type to copyreg's, if it has one (else the pickler uses
    the object's own __reduce_ex__)."""

    def __init__(self, tensor):
        super().__init__()
        self._tensor_reduction = tensor

    def __missing__(self, kind):
        if isinstance(kind, type) and issubclass(kind, torch.Tensor):
            self[kind] = self._tensor_reduction
            return self._tensor_reduction
        return copyreg.dispatch_table[kind]  # KeyError: the pickler's own way


class _Unpickler(pickle.Unpickler):
    """Loads a remainder: each _Tensor(name) becomes own(name). load() resolves the dicts that
    went as their keys (_capture): the model's state dict (which load copies into the model and
    drops) to view(name)s, the optimizer's per-parameter states to state(name, key)s (load's:
    copies of their own, or views for an optimizer whose load_state_dict copies them)."""

    def __init__(self, data, view, own, state):
        super().__init__(io.BytesIO(data))
        self._view, self._state = view, state
        # "_Dict" and "_Dicts": the same dicts in checkpoints of format /1 (placeholder objects
        # in their places), which disk may still hold.
        self._classes = {"_Tensor": own, "_Dict": self._tensors, "_Dicts": self._dicts}

    def _tensors(self, keys, first):
        view = self._view
        return {k: view(str(first + j)) for j, k in enumerate(keys)}

    def _dicts(self, ids, keys, first):
        out, state = {}, self._state
        for i, ks in zip(ids, keys):
            out[i] = {k: state(str(first + j), k) for j, k in enumerate(ks)}
            first += len(ks)
        return out

    def load(self):
        rest = super().load()
        keys = rest.pop("model_keys", None)
        if keys is not None:
            rest["model"] = self._tensors(keys, 0)
        states = rest.pop("optimizer_states", None)
        if states is not None:
            rest["optimizer"]["state"] = self._dicts(*states)
        return rest

    def find_class(self, module, name):
        if module == __name__ and name in self._classes:
            return self._classes[name]
        return super().find_class(module, name)


def _same(a, b):
    """Whether lists a and b (or None) hold the same objects."""
    return a is b or (a is not None and b is not None and len(a) == len(b) and
                      all(map(operator.is_, a, b)))


class _Placed:
    """Which of the state's dicts go as their keys, and the tensors those hold, in order: the
    model's state dict when it holds only plain tensors, none twice (tied weights go through
    the pickler, which stores such a tensor once); the optimizer's per-parameter states when
    they are dicts of plain tensors, none met before. Kept from save to save: the same objects
    in the same places go the same way (held())."""

    def __init__(self, values, per_values):
        self.values, self.per_values = values, per_values
        self.model = values is not None and set(map(type, values)) <= _PLAIN_TENSOR and \
            len(set(map(id, values))) == len(values)
        tensors = values if self.model else []
        self.first = len(tensors)  # the index of the optimizer's first tensor
        self.optimizer = False
        if per_values is not None and set(map(type, per_values)) <= _PLAIN_TENSOR:
            together = tensors + per_values
            self.optimizer = len(set(map(id, together))) == len(together)
            if self.optimizer:
                tensors = together
        self.tensors = tuple(tensors)

    def held(self, values, per_values):
        return _same(values, self.values) and _same(per_values, self.per_values)


def _capture(model, optimizer, extra, pickler, placed=None):
    """([tensor], the pickled rest, the state, _Placed): the tensors of the state, in the order
    they are named, and everything else pickled with placeholders in their places. Lean, since
    a program may save at every step: the model's state dict and the optimizer's per-parameter
    states, when they hold only tensors, go as their keys, the rest through the C pickler; the
    tensors are the model's own, not detached copies (the copies run under torch.no_grad()).
    `placed`: the previous call's _Placed, reused when it holds the same tensors."""
    # The model's state in a plain dict: an OrderedDict's _metadata (module versions, for
    # load_state_dict) is not needed to copy the tensors back.
    sd = model.state_dict(destination={}, keep_vars=True) if model is not None else None
    osd = optimizer.state_dict() if optimizer is not None else None
    extra = dict(extra) if extra is not None else None
    values = list(sd.values()) if sd is not None else None
    per_param = osd.get("state") if osd is not None else None
    per = list(per_param.values()) if type(per_param) is dict else None
    per_values = list(chain.from_iterable(map(dict.values, per))) \
        if per is not None and set(map(type, per)) <= _DICT else None
    if placed is None or not placed.held(values, per_values):
        placed = _Placed(values, per_values)
    tensors = list(placed.tensors)  # the pickler appends the tensors it meets
    # A dict that goes as its keys is in a field of its own, the tensors it held named in
    # order from its first (the model's from "0"): plain tuples, which the C pickler writes
    # without a Python call or a class to look up.
    if placed.optimizer:
        optimizer_part = dict(osd, state=None)
        states = (tuple(per_param), tuple(map(tuple, per)), placed.first)
    else:
        optimizer_part, states = osd, None
    data = pickler.pickle({"model": None if placed.model else sd,
                           "model_keys": tuple(sd) if placed.model else None,
                           "optimizer": optimizer_part, "optimizer_states": states,
                           "extra": extra}, tensors)
    state = {"model": sd, "optimizer": osd, "extra": extra}
    if len(data) > MAX_REMAINDER_BYTES:
        sizes = []
        for part in ("model", "optimizer", "extra"):
            if isinstance(state.get(part), dict):
                for k, v in state[part].items():
                    sizes.append((len(_Pickler().pickle(v, [])), f"{part}.{k}"))
        biggest = max(sizes, default=(0, "?"))
        raise ValueError(f"lockstep.torch.Checkpointer: the non-tensor part of the state is "
                         f"{len(data)} bytes pickled, more than {MAX_REMAINDER_BYTES}; the "
                         f"largest is {biggest[1]} ({biggest[0]} bytes): keep large values in "
                         f"tensors")
    return tensors, data, state, placed


def _check_tensors(tensors, state):
    """Raises TypeError naming a tensor a checkpoint cannot hold (checked per layout: the
    layout's key holds each tensor's dtype and whether it is sparse)."""
    for t in tensors:
        if t.dtype not in _DTYPES or t.is_sparse:
            raise TypeError(f"lockstep.torch.Checkpointer: {_path_of(state, t)} is a "
                            f"{'sparse ' if t.is_sparse else ''}{t.dtype} tensor, "
                            f"which a checkpoint cannot hold")


def _path_of(rest, target):
    """Where `target` is in the state, for an error message ("extra.grid")."""
    def find(prefix, value):
        if value is target:
            return prefix
        items = (value.items() if isinstance(value, dict) else
                 enumerate(value) if isinstance(value, (list, tuple)) else ())
        for k, v in items:
            if isinstance(v, _CONTAINERS):
                found = find(f"{prefix}.{k}" if prefix else str(k), v)
                if found:
                    return found
        return None
    return find("", rest) or "a tensor inside an object of the state"


class _Layout:
    """Where each tensor goes in the safetensors payload (computed once per set of dtypes and
    shapes). The header names each tensor by its index in the state: the remainder places it."""

    def __init__(self, tensors, key, remainder_bytes):
        """key: the tensors' (dtype, shape, device, is_sparse), then remainder_bytes."""
        # Widest elements first: every tensor starts aligned to its own element size. Then by
        # dtype, so that the tensors of one dtype are one run (copied by one torch.cat).
        order = sorted(range(len(tensors)),
                       key=lambda i: (-tensors[i].element_size(), str(tensors[i].dtype)))
        header, offset, self.entries = {}, 0, []
        for i in order:
            t = tensors[i]
            n = t.numel() * t.element_size()
            header[str(i)] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [offset, offset + n]}
            self.entries.append((i, offset, n))
            offset += n
        # The state's tensors in the payload's order, in one call.
        self.sources = (operator.itemgetter(*order) if len(order) > 1 else
                        lambda tensors: tuple(tensors[i] for i in order))
        # [(dtype, offset, elements, first entry, end entry)]: consecutive entries of one dtype
        self.runs = []
        for e, (i, begin, n) in enumerate(self.entries):
            t = tensors[i]
            if self.runs and self.runs[-1][0] == t.dtype:
                dtype, at, count, first, _ = self.runs[-1]
                self.runs[-1] = (dtype, at, count + t.numel(), first, e + 1)
            else:
                self.runs.append((t.dtype, begin, t.numel(), e, e + 1))
        header[_REMAINDER] = {"dtype": "U8", "shape": [remainder_bytes],
                              "data_offsets": [offset, offset + remainder_bytes]}
        # The entries' lengths, for lockstep_gather_xxh3 (their addresses are the slot's).
        self.sizes = (ctypes.c_uint64 * len(self.entries))(*[n for _, _, n in self.entries])
        self.on_device = any(t.is_cuda for t in tensors)  # staged through pinned memory
        self.on_host = all(t.device.type == "cpu" for t in tensors)  # _host_sources
        self.key = key
        # The step is in the slot's header, not here: one safetensors header per layout.
        header["__metadata__"] = {"format": "lockstep.torch.Checkpointer/2"}
        # Where each tensor off the host was (load puts it back on a device of that kind):
        # safetensors' metadata holds strings only.
        devices = {str(i): str(t.device) for i, t in enumerate(tensors) if t.device.type != "cpu"}
        if devices:
            header["__metadata__"]["devices"] = json.dumps(devices, separators=(",", ":"))
        text = json.dumps(header, separators=(",", ":")).encode()
        # Data starts 64-byte aligned in the slot (the header ends padded with spaces).
        self.header = text + b" " * ((-(HEADER_BYTES + 8 + len(text))) % 64)
        self.data_start = HEADER_BYTES + 8 + len(self.header)  # in the slot
        self.remainder_start = self.data_start + offset
        self.payload_bytes = 8 + len(self.header) + offset + remainder_bytes


def _loads_into_state(optimizer):
    """Whether optimizer.load_state_dict is torch.optim's own, neither replaced (in the class or
    on the object) nor hooked: what it is given then ends up in optimizer.state and
    optimizer.param_groups and nowhere else (deep-copied before torch 2.1; since, as given where
    the dtype and device match)."""
    return type(optimizer).load_state_dict is torch.optim.Optimizer.load_state_dict and \
        "load_state_dict" not in vars(optimizer) and \
        not getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", None) and \
        not getattr(optimizer, "_optimizer_load_state_dict_post_hooks", None)


def _copy_out(value, begin, end):
    """Replaces, in the dicts and lists of `value`, every tensor whose memory starts in
    [begin, end) (a view of a mapping about to close) by a copy of its own."""
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(v, torch.Tensor):
            if begin <= v.data_ptr() < end:
                value[k] = v.clone()
        elif isinstance(v, (dict, list)):
            _copy_out(v, begin, end)


class _HostCopy:
    """How a save of host tensors, each contiguous, was copied (Checkpointer._host_sources):
    its layout, its tensors in the payload's order and what copies them. It holds for the next
    save while that one's tensors are the same objects (held here, and so their storage) at
    the same addresses, each of the same dtype and shape and contiguous, and the remainder is
    as long: then they are the same memory, and their layout is the same (a tensor's place
    depends on its dtype, shape, device and sparsity: one at the same address is on the same
    device, and a sparse one has none)."""

    def __init__(self, layout, tensors, sources, host):
        self.layout, self.sources, self.host = layout, sources, host
        self.tensors = list(tensors)
        self.ptrs = list(map(_DATA_PTR, tensors))
        self.shapes = list(map(_DTYPE_SHAPE, tensors))

    def fits(self, tensors, remainder_bytes):
        if remainder_bytes != self.layout.key[-1] or not _same(tensors, self.tensors):
            return False
        try:
            return list(map(_DATA_PTR, tensors)) == self.ptrs and \
                list(map(_DTYPE_SHAPE, tensors)) == self.shapes and all(map(_CONTIGUOUS, tensors))
        except RuntimeError:  # a tensor without storage (sparse, now) has no address
            return False


class _Slot:
    def __init__(self, path):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        self.map = mmap.mmap(self.fd, self.size)
        # Its address (torch.frombuffer holds no export: the mapping can close).
        self.base = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()
        # The commit sequence as one 8-byte word (struct packs '<Q' byte by byte: a kill in
        # between would leave a valid-looking, wrong sequence).
        self._word = memoryview(self.map)[8:16].cast("Q")
        # What prepare() set up for the last layout written here: its safetensors header is in
        # place, and the views of its tensors, of its runs and of its payload, and the addresses
        # of its entries, are kept.
        self.layout = None
        self.views = self.run_views = self.payload = self.dsts = None

    def sequence(self):
        return self._word[0]  # the worker makes a slot zeroed; this class writes the magic

    def store_sequence(self, value):
        self._word[0] = value

    def prepare(self, layout, tensors):
        """Zeroes the commit sequence (the slot is not committed while written) and makes the
        slot ready for a save of `layout`."""
        self._word[0] = 0
        if self.layout is layout:
            return
        m, start = self.map, layout.data_start
        struct.pack_into("<8s", m, 0, MAGIC)
        struct.pack_into("<Q", m, HEADER_BYTES, len(layout.header))
        m[HEADER_BYTES + 8:start] = layout.header
        self.release()
        self.views = [torch.frombuffer(m, dtype=tensors[i].dtype, count=tensors[i].numel(),
                                       offset=start + offset).view(tensors[i].shape)
                      if n else torch.empty(tensors[i].shape, dtype=tensors[i].dtype)
                      for i, offset, n in layout.entries]
        self.run_views = [torch.frombuffer(m, dtype=dtype, count=count, offset=start + offset)
                          if count else torch.empty(0, dtype=dtype)
                          for dtype, offset, count, _, _ in layout.runs]
        self.payload = memoryview(m)[HEADER_BYTES:HEADER_BYTES + layout.payload_bytes]
        self.dsts = (ctypes.c_uint64 * len(layout.entries))(
            *[self.base + start + offset for _, offset, _ in layout.entries])
        self.layout = layout

    def release(self):
        """Drops the views into the mapping. The payload's memoryview is an export (the mapping
        cannot close while it lives); torch.frombuffer's views hold none: none may outlive it."""
        if self.payload is not None:
            self.payload.release()
        self.layout = None
        self.views = self.run_views = self.payload = self.dsts = None

    def close(self):
        self.release()
        self._word.release()
        self.map.close()
        os.close(self.fd)


class Checkpointer:
    def __init__(self, fallback_dir=None):
        self.extra = None
        self._fallback = None
        self._slots = []
        self._restored = False
        self._last_step = None
        self._layout = None
        self._placed = None  # the last save's _Placed
        self._flat = None  # the last save's _HostCopy, when it has one
        self._checksum = ctypes.c_uint64()  # lockstep_gather_xxh3's
        self._hold_at = _hold_at()
        self._pickler = _Pickler()
        self._saving = False  # a save in progress: one may not start inside another
        self._pending = None  # the SaveHandle of a save not yet committed
        self._staging = None  # (tensors' key, pinned host buffers for GPU tensors): blocking=False
        self._streams = {}  # device -> the side stream of its copies to the staging buffers
        if not _agent.available():
            if fallback_dir is None:
                raise RuntimeError(
                    "lockstep.torch.Checkpointer: not running under a Lockstep worker "
                    "(LOCKSTEP_AGENT_ADDRESS and LOCKSTEP_AGENT_TOKEN are not set); pass "
                    "fallback_dir=DIR to save with torch.save to DIR instead")
            self._fallback = str(fallback_dir)

    # ----------------------------------------------------------------------------------------
    # save

    def save(self, step, model, optimizer=None, extra=None, blocking=True):
        """Copies the state at optimizer step `step` into the worker's memory and returns when
        the copy is committed. A save of the step saved last is a no-op.

        With blocking=False it returns a SaveHandle once the state is captured, and the rest
        goes on in a thread, overlapping the next step: CPU tensors are copied into the slot
        before it returns, their checksum and the commit follow in the thread; GPU tensors'
        copies to pinned host buffers are enqueued on a side stream of their device that the
        device's current stream then waits for (later work on the device, the next forward
        included, cannot change them under the copy, and the host does not wait), and the
        thread copies them on into the slot. A state held on the host whose payload is at most
        INLINE_COMMIT_BYTES is committed before it returns (a thread costs more than its
        checksum). The next save waits until this one is committed; handle.wait() waits for
        the commit and raises what failed (the next save then does not raise it again)."""
        if self._saving:
            raise RuntimeError("lockstep.torch.Checkpointer.save: called inside a save (from a "
                               "signal handler?); a save must return before the next starts")
        self._saving = True
        try:
            return self._save(int(step), model, optimizer, extra, blocking)
        finally:
            self._saving = False

    def _save(self, step, model, optimizer, extra, blocking):
        if self._pending is not None:
            self.wait()  # the previous save owns the slots until it is committed
        if step == self._last_step:
            return None if blocking else SaveHandle.completed()
        if self._fallback is not None:
            self._save_fallback(step, model, optimizer, extra)
            self._last_step = step
            return None if blocking else SaveHandle.completed()
        tensors, remainder, state, self._placed = _capture(model, optimizer, extra,
                                                           self._pickler, self._placed)
        flat = self._flat
        if flat is not None and flat.fits(tensors, len(remainder)):
            layout, sources, host = flat.layout, flat.sources, flat.host
        else:
            self._flat = None
            key = (*map(_LAYOUT_OF, tensors), len(remainder))
            layout = self._layout
            if layout is None or layout.key != key:
                _check_tensors(tensors, state)
                layout = self._layout = _Layout(tensors, key, len(remainder))
            sources = layout.sources(tensors)
            host = self._host_sources(layout, tensors, sources) if layout.on_host else None
            if not layout.on_host:
                self._placed = None  # a device's memory is not held from one save to the next
        payload_bytes = layout.payload_bytes
        slot, sequence = self._slot_for(HEADER_BYTES + payload_bytes)
        slot.prepare(layout, tensors)
        m, views = slot.map, slot.views
        r = layout.remainder_start

        def copy(hash_it):
            """Copies the state into the slot; returns the payload's checksum when hash_it and
            the copy computed it on the way (lockstep_gather_xxh3), else None."""
            m[r:r + len(remainder)] = remainder  # first: the gather hashes the payload whole
            if host is None:
                with torch.no_grad():
                    for src, view in zip(sources, views):
                        view.copy_(src)  # same shape: the layout's key holds it
            elif type(host) is list:  # one cat per dtype: a dispatch per tensor is most of a save
                for flat, out in zip(host, slot.run_views):
                    torch.cat(flat, out=out)
            else:
                checksum = self._checksum if hash_it else None
                if _GATHER(len(layout.entries), host, slot.dsts, layout.sizes,
                           slot.base + HEADER_BYTES, payload_bytes, checksum) != 0:
                    raise RuntimeError("lockstep.torch.Checkpointer: the native copy refused "
                                       "(a source of no memory or a destination outside the "
                                       "slot's payload: a bug; or no memory for its hash)")
                return checksum.value if hash_it else None
            return None

        def commit(checksum=None):
            if step == self._hold_at:
                _hold_for_test()
            if checksum is None:
                checksum = _hash_payload(slot, payload_bytes)
            struct.pack_into("<qQQ", m, 16, step, payload_bytes, checksum)
            slot.store_sequence(sequence)  # the commit: written last

        on_device = layout.on_device
        if blocking or (not on_device and payload_bytes <= INLINE_COMMIT_BYTES):
            commit(copy(True))
            self._last_step = step
            return None if blocking else SaveHandle.completed(step)
        handle = SaveHandle(step)
        events = []
        if on_device:
            # Device -> pinned host memory on a side stream of each device, after the work that
            # produced the state there; later work on a device waits for its copies, the host
            # does not.
            tensors_key = layout.key[:-1]  # a remainder of another length: the same buffers
            if self._staging is None or self._staging[0] != tensors_key:
                self._staging = (tensors_key,
                                 [torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                  if t.is_cuda else None for t in sources])
            staging = self._staging[1]
            by_device = {}
            for st, t in zip(staging, sources):
                if st is not None:
                    by_device.setdefault(t.device, []).append((st, t))
            for device, pairs in by_device.items():
                # The streams and the event of the tensors' own device (not the current one: a
                # script may use cuda:1 without making it current).
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device)
                current = torch.cuda.current_stream(device)
                stream.wait_stream(current)
                with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():
                    for st, t in pairs:
                        st.copy_(t, non_blocking=True)
                        # Memory freed meanwhile (a tensor made on another stream) is not
                        # given out again before the copy ends.
                        t.record_stream(stream)
                event = torch.cuda.Event(blocking=True)  # the thread sleeps in synchronize()
                event.record(stream)
                current.wait_event(event)
                events.append(event)
            # The host's tensors (Adam's step counts, for one) change at the next step: they
            # are copied before save returns; the thread copies only the staged ones.
            with torch.no_grad():
                for st, t, view in zip(staging, sources, views):
                    if st is None:
                        view.copy_(t)
            m[r:r + len(remainder)] = remainder
        else:
            copy(False)  # the host's tensors: captured before save returns, hashed in the thread

        def run():
            try:
                if events:
                    for event in events:
                        event.synchronize()
                    with torch.no_grad():
                        for st, view in zip(staging, views):
                            if st is not None:
                                view.copy_(st)
                commit()
            except BaseException as e:  # noqa: BLE001: handed to wait()
                handle._error = e
            finally:
                handle._done.set()

        handle._thread = threading.Thread(target=run, name=f"lockstep-save-{step}")
        self._pending = handle  # before it starts: a running thread is always waited for
        try:
            handle._thread.start()
        except BaseException:
            self._pending = None  # it never ran: the slot stays uncommitted, nothing to wait for
            raise
        self._last_step = step
        return handle

    def wait(self):
        """Waits for a save made with blocking=False to be committed; raises what failed, unless
        its handle's wait() raised it already."""
        pending, self._pending = self._pending, None
        if pending is not None:
            reported = pending._reported
            try:
                pending.wait()
            except BaseException:
                self._last_step = None  # not committed: a save of that step again is not a no-op
                if not reported:
                    raise

    def _slot_for(self, need):
        """The slot to write next (the older save), mapped and at least `need` bytes, and the
        sequence that commits it."""
        if not self._restored:
            self.load(None)  # the group's agreement comes first (it may discard saves)
        if not self._slots or self._slots[0].size < need:
            response = _agent.call(_agent.agent().CheckpointSlots,
                                   _program_pb2().CheckpointSlotsRequest(bytes=need),
                                   what="lockstep.torch.Checkpointer.save")
            for s in self._slots:
                s.close()
            self._slots = [_Slot(p) for p in response.paths]
        a, b = self._slots
        sa, sb = a.sequence(), b.sequence()
        return (a, sb + 1) if sa <= sb else (b, sa + 1)

    def _host_sources(self, layout, tensors, sources):
        """What copies a state held on the host whose tensors are all contiguous (None when one
        is not): the tensors' addresses in the payload's order (a ctypes array), for
        lockstep_gather_xxh3, when each is a plain tensor whose memory holds its values; else
        (a negative view, a zero tensor, a subclass: torch resolves them) a list, for each of
        the layout's runs, of flat views of its tensors, torch.cat's inputs. Kept for the next
        saves (_HostCopy)."""
        if not all(map(_CONTIGUOUS, sources)):
            return None
        ptrs = list(map(_DATA_PTR, sources))
        if _GATHER is not None and set(map(type, sources)) <= _PLAIN_TENSOR and \
                not any(map(_NEGATIVE, sources)) and not any(map(_ZERO, sources)):
            host = (ctypes.c_uint64 * len(ptrs))(*ptrs)
        else:
            flat = [t.detach().view(-1) for t in sources]
            host = [flat[first:end] for _, _, _, first, end in layout.runs]
        self._flat = _HostCopy(layout, tensors, sources, host)
        return host

    # ----------------------------------------------------------------------------------------
    # load

    def load(self, model, optimizer=None, map_location=None):
        """Restores the group's newest common state into `model` (in place) and `optimizer`;
        returns its step, or None when there is none (a fresh start). Sets self.extra.

        The model's tensors are filled where they are. Every other tensor (the optimizer's,
        self.extra's) comes back on a device of the kind it was saved on (_homes): the one
        saved when the model or the optimizer's parameters are there now, else one of theirs
        of that kind (a restarted rank may have another LOCAL_RANK), else the current GPU for
        one saved on a GPU, else the device saved. map_location (a device, as torch.load's)
        puts them all there instead. The optimizer's load_state_dict then moves its
        per-parameter states to their parameters' devices, as it does."""
        if map_location is not None:
            try:
                map_location = torch.device(map_location)
            except (TypeError, RuntimeError) as e:
                why = str(e).splitlines()[0]
                raise ValueError(f"lockstep.torch.Checkpointer.load: map_location "
                                 f"{map_location!r} is not a device ({why})") from None
        if self._fallback is not None:
            return self._load_fallback(model, optimizer, map_location)
        started = time.monotonic()
        response = _agent.call(_agent.agent().CheckpointRestore,
                               _program_pb2().CheckpointRestoreRequest(),
                               what="lockstep.torch.Checkpointer.load")
        self._restored = True
        if not response.found:
            return None
        if model is None and optimizer is None:
            return int(response.step)
        with open(response.path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable: torch.frombuffer
        try:
            self._fill(m, int(response.step), model, optimizer, map_location)
        finally:
            m.close()
        self._last_step = int(response.step)
        # Restored: the recovery in status says from where, and how long it took.
        _agent.call(_agent.agent().CheckpointRestore,
                    _program_pb2().CheckpointRestoreRequest(
                        loaded=True, step=self._last_step,
                        loaded_ms=int((time.monotonic() - started) * 1000)),
                    what="lockstep.torch.Checkpointer.load")
        return self._last_step

    def _fill(self, m, step, model, optimizer, map_location):
        (n,) = struct.unpack_from("<Q", m, HEADER_BYTES)
        header = json.loads(bytes(m[HEADER_BYTES + 8:HEADER_BYTES + 8 + n]))
        data_start = HEADER_BYTES + 8 + n
        metadata = header.pop("__metadata__", None) or {}
        devices = json.loads(metadata.get("devices", "{}"))  # not in checkpoints of the host

        def tensor(name):
            """A view of the tensor `name` in the mapping (which closes when load returns)."""
            if name not in header:
                raise KeyError(f"lockstep.torch.Checkpointer: the checkpoint of step {step} "
                               f"has no tensor {name}")
            e = header[name]
            begin, end = e["data_offsets"]
            dtype = _TORCH_DTYPES[e["dtype"]]
            count = (end - begin) // torch.empty((), dtype=dtype).element_size()
            if count == 0:
                return torch.empty(e["shape"], dtype=dtype)
            return torch.frombuffer(m, dtype=dtype, count=count,
                                    offset=data_start + begin).view(e["shape"])

        remainder = tensor(_REMAINDER).numpy().tobytes()
        direct = optimizer is not None and _loads_into_state(optimizer)
        goes = {}  # a tensor's name -> the device it goes to (the others stay on the host)
        if devices or map_location is not None:
            goes = self._devices(remainder, tensor, devices, step, model, optimizer, direct,
                                 map_location)

        # torch.frombuffer holds no export of the mapping, which closes when load returns:
        # every tensor kept past load is copied out of it (once, however often it is met). The
        # model's tensors (its state dict when it went as its keys) are views, copied into the
        # model below; so are the optimizer's per-parameter states when its load_state_dict is
        # torch's own (_loads_into_state): the views it keeps are copied after, so that each
        # tensor is copied once (a copy before it, which torch before 2.1 deep-copies again,
        # restored a 1 GiB Adam state in 1.15-2.55 s, against 0.64-0.98 s). A tensor that goes
        # to a device is copied there from the mapping.
        owned = {}

        def own(name):
            t = owned.get(name)
            if t is None:
                d = goes.get(name)
                t = owned[name] = tensor(name).clone() if d is None else \
                    tensor(name).to(d, copy=True)
            return t

        def state(name, key):
            """A per-parameter state for torch's own load_state_dict, which puts each on its
            parameter's device but "step" (torch 1.13 leaves it as it is given; later versions
            as well, unless the optimizer is capturable or fused): a view of the mapping, or,
            for a "step" that goes to a device (_devices), its copy there. Only "step": a state
            handed on the GPU would be deep-copied there again by torch before 2.1, twice its
            memory on the device."""
            d = goes.get(name)
            return tensor(name) if d is None else tensor(name).to(d)

        rest = _Unpickler(remainder, view=tensor, own=own,
                          state=state if direct else lambda name, key: own(name)).load()

        if model is not None:
            if rest["model"] is None:
                raise KeyError(f"lockstep.torch.Checkpointer: the checkpoint of step {step} "
                               f"holds no model")
            saved = rest["model"]
            own = model.state_dict()
            for k in saved:
                if k not in own:
                    raise KeyError(f"lockstep.torch.Checkpointer: the checkpoint's tensor "
                                   f"model.{k} is not in the model")
            with torch.no_grad():
                for k, dst in own.items():
                    if k not in saved:
                        raise KeyError(f"lockstep.torch.Checkpointer: the checkpoint of step "
                                       f"{step} has no tensor model.{k}")
                    src = saved[k]
                    if isinstance(dst, torch.Tensor):
                        if not isinstance(src, torch.Tensor):
                            raise TypeError(f"lockstep.torch.Checkpointer: model.{k} is a "
                                            f"tensor, the checkpoint's a {type(src).__name__}")
                        if tuple(src.shape) != tuple(dst.shape):
                            raise ValueError(
                                f"lockstep.torch.Checkpointer: model.{k} has shape "
                                f"{tuple(dst.shape)}, the checkpoint's {tuple(src.shape)}")
                        dst.copy_(src)  # straight from the mapping into the model: one copy
        if optimizer is not None:
            if rest["optimizer"] is None:
                raise KeyError(f"lockstep.torch.Checkpointer: the checkpoint of step {step} "
                               f"holds no optimizer state")
            optimizer.load_state_dict(rest["optimizer"])
            if direct:
                begin = torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
                _copy_out(optimizer.state, begin, begin + len(m))
                _copy_out(optimizer.param_groups, begin, begin + len(m))
        self.extra = rest["extra"]

    @staticmethod
    def _devices(remainder, tensor, devices, step, model, optimizer, direct, map_location):
        """{name: device} for each tensor of the state that load puts on a device: those saved
        on one (`devices`, the header's), or all with map_location; raises, naming the tensor,
        when one has no device of its kind here. Never the model's (filled in place, wherever
        it was saved); of the per-parameter states that torch's own load_state_dict gets
        (`direct`: it puts them on their parameters' devices), only a "step" (which it leaves
        where it is: Adam's with capturable=True must be on the GPU), and that one only where
        its device's kind is here. A load of the remainder that leaves every tensor in the
        mapping says which tensors are the model's (its state dict goes through the pickler
        when it has tied weights) and the optimizer's, and where each is in the state."""
        met = {}

        def view(name, key=None):
            t = met.get(name)
            if t is None:
                t = met[name] = tensor(name)
            return t
        probe = _Unpickler(remainder, view=view, own=view, state=view).load()
        skip = {id(t) for t in probe["model"].values()} \
            if isinstance(probe.get("model"), dict) else set()
        steps = set()  # the per-parameter states' "step"s
        states = (probe.get("optimizer") or {}).get("state") if direct else None
        for per in states.values() if isinstance(states, dict) else ():
            for k, t in per.items() if isinstance(per, dict) else ():
                (steps if k == "step" else skip).add(id(t))
        home = _homes(model, optimizer, map_location)
        goes = {}
        for name, t in met.items():
            saved = devices.get(name, "cpu")
            if id(t) in skip or (map_location is None and saved == "cpu"):
                continue
            d = home(saved)
            if d is not None:
                goes[name] = d
            elif id(t) not in steps:
                raise _no_device(f"{_path_of(probe, t)} of the checkpoint of step {step}", saved)
        return goes

    # ----------------------------------------------------------------------------------------
    # outside Lockstep

    def _fallback_path(self):
        return os.path.join(self._fallback, f"checkpoint-rank{os.environ.get('RANK', '0')}.pt")

    def _save_fallback(self, step, model, optimizer, extra):
        os.makedirs(self._fallback, exist_ok=True)
        path = self._fallback_path()
        buf = io.BytesIO()
        torch.save({"step": step, "model": model.state_dict() if model is not None else None,
                    "optimizer": optimizer.state_dict() if optimizer is not None else None,
                    "extra": extra}, buf)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _load_fallback(self, model, optimizer, map_location):
        path = self._fallback_path()
        if not os.path.exists(path):
            return None

        home = _homes(model, optimizer, map_location)

        def restore(storage, location):  # where load() puts a tensor: as the slots' (docstring)
            if map_location is None and location == "cpu":
                return storage
            device = home(location)
            if device is None:
                raise _no_device(f"a tensor of {path}", location)
            return storage if device.type == "cpu" else \
                torch.serialization.default_restore_location(storage, str(device))
        # This process's own file, pickled objects in `extra` included (torch 2.6 and later
        # load tensors only by default).
        state = torch.load(path, map_location=restore, weights_only=False)
        if model is not None:
            model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        self.extra = state["extra"]
        self._last_step = int(state["step"])
        return self._last_step


def _homes(model, optimizer, map_location):
    """home(saved): the device that Checkpointer.load restores a tensor saved on device `saved`
    to (None: none of its kind here). map_location when given; else the device saved when the
    model or the optimizer's parameters have a tensor there now; else the first of theirs of
    that kind (a restarted rank's GPU may have another index); else, for a GPU, the current
    one; else the device saved."""
    if map_location is not None:
        return lambda saved: map_location
    here = {}  # the devices of the model's tensors and the optimizer's parameters, in order
    if model is not None:
        for t in chain(model.parameters(), model.buffers()):
            here.setdefault(t.device)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                here.setdefault(p.device)
    known = {}

    def where(saved):
        s = torch.device(saved)
        if s in here:
            return s
        for h in here:
            if h.type == s.type:
                return h
        if s.type != "cuda":
            return s
        return torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else None

    def home(saved):
        if saved not in known:
            known[saved] = where(saved)
        return known[saved]
    return home


def _no_device(what, saved):
    """The error of a load that has no device of the kind `what` was saved on."""
    return RuntimeError(f"lockstep.torch.Checkpointer: {what} was saved on {saved}, and this "
                        f"process has no {torch.device(saved).type} device; "
                        f"load(..., map_location=\"cpu\") puts it on the host")


class SaveHandle:
    """A save made with blocking=False: wait() returns once it is committed in the worker's
    memory (and raises what failed); done() says whether it is."""

    def __init__(self, step):
        self.step = step
        self._done = threading.Event()
        self._error = None
        self._reported = False  # wait() raised the error: the next save does not raise it again
        self._thread = None

    @classmethod
    def completed(cls, step=None):
        h = cls(step)
        h._done.set()
        return h

    def done(self):
        return self._done.is_set()

    def wait(self):
        self._done.wait()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self._reported = True
            raise self._error


def _program_pb2():
    from lockstep.v1 import program_pb2
    return program_pb2


def _hold_at():
    """Test hook: with LOCKSTEP_TEST_HOLD_SAVE_AT_STEP=N in the environment when a Checkpointer
    is made, its save of step N stops after its tensors are copied and before its commit (in
    _hold_for_test), having created LOCKSTEP_TEST_HOLD_SAVE_FILE. Read once: a save looks at
    an int, not the environment."""
    at = os.environ.get("LOCKSTEP_TEST_HOLD_SAVE_AT_STEP")
    return None if at is None else int(at)


def _hold_for_test():
    marker = os.environ.get("LOCKSTEP_TEST_HOLD_SAVE_FILE")
    if marker:  # whole when it appears: a test reads the pid as soon as it sees the file
        with open(f"{marker}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"{marker}.tmp", marker)
    while True:
        time.sleep(1)
