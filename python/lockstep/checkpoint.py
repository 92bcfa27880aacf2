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
import io
import json
import mmap
import os
import pickle
import struct
import threading
import time

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


class _Tensor:
    """A placeholder for a tensor in the pickled remainder."""

    def __init__(self, name):
        self.name = name

    def __reduce__(self):  # pickled as _Tensor(name): a third faster than by its __dict__
        return _Tensor, (self.name,)


def _xxh3(view):
    try:
        import xxhash
    except ImportError:
        raise RuntimeError("lockstep.torch.Checkpointer needs the xxhash module "
                           "(Debian: python3-xxhash)") from None
    return xxhash.xxh3_64_intdigest(view)


def _flatten(model, optimizer, extra):
    """[(name, tensor)], the picklable rest (tensors replaced by _Tensor(name)) and the layout's
    key: one walk, kept lean, since a program may save at every step (the model's own tensors,
    not detached copies: the copies run under torch.no_grad())."""
    tensors, key = [], []

    def tensor(prefix, value):
        dtype = value.dtype
        if dtype not in _DTYPES or value.is_sparse:
            raise TypeError(f"lockstep.torch.Checkpointer: {prefix} is a "
                            f"{'sparse ' if value.is_sparse else ''}{dtype} tensor, "
                            f"which a checkpoint cannot hold")
        # Named by position too: "a.b" in extra and extra["a"]["b"] stay two tensors.
        name = f"{len(tensors)}:{prefix}"
        tensors.append((name, value))
        key.append((name, dtype, value.shape))
        return _Tensor(name)

    def take(prefix, value):
        if isinstance(value, torch.Tensor):
            return tensor(prefix, value)
        if isinstance(value, dict):
            return {k: (tensor(f"{prefix}.{k}", v) if isinstance(v, torch.Tensor) else
                        take(f"{prefix}.{k}", v) if isinstance(v, _CONTAINERS) else v)
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            for v in value:
                if isinstance(v, _CONTAINERS):
                    return type(value)(take(f"{prefix}.{i}", v) for i, v in enumerate(value))
            return value  # e.g. a param group's parameter indices
        return value

    rest = {"model": take("model", model.state_dict(keep_vars=True)) if model is not None
            else None,
            "optimizer": take("optimizer", optimizer.state_dict()) if optimizer is not None
            else None,
            "extra": take("extra", dict(extra)) if extra is not None else None}
    return tensors, rest, tuple(key)


def _pickle_rest(rest):
    data = pickle.dumps(rest, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_REMAINDER_BYTES:
        sizes = []
        for part in ("model", "optimizer", "extra"):
            if isinstance(rest.get(part), dict):
                for k, v in rest[part].items():
                    sizes.append((len(pickle.dumps(v)), f"{part}.{k}"))
        biggest = max(sizes, default=(0, "?"))
        raise ValueError(f"lockstep.torch.Checkpointer: the non-tensor part of the state is "
                         f"{len(data)} bytes pickled, more than {MAX_REMAINDER_BYTES}; the "
                         f"largest is {biggest[1]} ({biggest[0]} bytes): keep large values in "
                         f"tensors")
    return data


class _Layout:
    """Where each tensor goes in the safetensors payload (computed once per set of shapes)."""

    def __init__(self, tensors, key, remainder_bytes):
        # Widest elements first: every tensor starts aligned to its own element size.
        order = sorted(range(len(tensors)), key=lambda i: -tensors[i][1].element_size())
        header, offset, self.entries = {}, 0, []
        for i in order:
            name, t = tensors[i]
            n = t.numel() * t.element_size()
            header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + n]}
            self.entries.append((i, offset, n))
            offset += n
        header[_REMAINDER] = {"dtype": "U8", "shape": [remainder_bytes],
                              "data_offsets": [offset, offset + remainder_bytes]}
        self.remainder_offset = offset
        self.data_bytes = offset + remainder_bytes
        self.key = key + (remainder_bytes,)
        # The step is in the slot's header, not here: one safetensors header per layout.
        header["__metadata__"] = {"format": "lockstep.torch.Checkpointer/1"}
        text = json.dumps(header, separators=(",", ":")).encode()
        # Data starts 64-byte aligned in the slot (the header ends padded with spaces).
        self.header = text + b" " * ((-(HEADER_BYTES + 8 + len(text))) % 64)


class _Slot:
    def __init__(self, path):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        self.map = mmap.mmap(self.fd, self.size)
        # (layout key, data start, [views]) of the last save: its safetensors header is in place
        self.views = None

    def sequence(self):
        magic, seq = struct.unpack_from("<8sQ", self.map, 0)
        return seq if magic == MAGIC else 0

    def close(self):
        self.views = None
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
        self._pending = None  # the SaveHandle of a save not yet committed
        self._staging = None  # pinned host buffers for GPU tensors (blocking=False)
        self._stream = None
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
        copies to pinned host buffers are enqueued on a side stream that the current stream
        then waits for (later work on the device, the next forward included, cannot change
        them under the copy, and the host does not wait), and the thread copies them on into
        the slot. A state held on the host whose payload is at most INLINE_COMMIT_BYTES is
        committed before it returns (a thread costs more than its checksum). The next save
        waits until this one is committed; handle.wait() waits for the commit and raises what
        failed."""
        step = int(step)
        self.wait()  # the previous save owns the slots until it is committed
        if step == self._last_step:
            return None if blocking else SaveHandle.completed()
        if self._fallback is not None:
            self._save_fallback(step, model, optimizer, extra)
            self._last_step = step
            return None if blocking else SaveHandle.completed()
        tensors, rest, key = _flatten(model, optimizer, extra)
        remainder = _pickle_rest(rest)
        layout = self._layout
        if layout is None or layout.key != key + (len(remainder),):
            layout = self._layout = _Layout(tensors, key, len(remainder))
            self._staging = None
        head = layout.header
        payload_bytes = 8 + len(head) + layout.data_bytes
        slot = self._slot_for(HEADER_BYTES + payload_bytes)
        other = [s for s in self._slots if s is not slot][0]
        sequence = max(slot.sequence(), other.sequence()) + 1
        m = slot.map
        _store_sequence(m, 0)  # not committed while written
        data_start = HEADER_BYTES + 8 + len(head)
        if slot.views is None or slot.views[0] != layout.key:  # else this slot holds it
            struct.pack_into("<8s", m, 0, MAGIC)
            struct.pack_into("<Q", m, HEADER_BYTES, len(head))
            m[HEADER_BYTES + 8:data_start] = head
        views = self._views(slot, layout, data_start, tensors)
        r = data_start + layout.remainder_offset
        sources = [tensors[i][1] for i, _, _ in layout.entries]

        def copy(srcs):
            with torch.no_grad():
                for src, view in zip(srcs, views):
                    view.copy_(src)  # same shape: the layout's key holds it
            m[r:r + len(remainder)] = remainder

        def commit():
            _hold_for_test(step)
            checksum = _xxh3(memoryview(m)[HEADER_BYTES:HEADER_BYTES + payload_bytes])
            struct.pack_into("<qQQ", m, 16, step, payload_bytes, checksum)
            _store_sequence(m, sequence)  # the commit: written last

        on_device = any(t.is_cuda for t in sources)
        if blocking or (not on_device and payload_bytes <= INLINE_COMMIT_BYTES):
            copy(sources)
            commit()
            self._last_step = step
            return None if blocking else SaveHandle.completed(step)
        handle = SaveHandle(step)
        event = None
        if on_device:
            # Device -> pinned host memory on a side stream, after the work that produced the
            # state; later work on the device waits for these copies, the host does not.
            if self._staging is None:
                self._staging = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                 if t.is_cuda else None for t in sources]
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream), torch.no_grad():
                for i, t in enumerate(sources):
                    if t.is_cuda:
                        self._staging[i].copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
            torch.cuda.current_stream().wait_event(event)
            sources = [st if st is not None else t for st, t in zip(self._staging, sources)]
        else:
            copy(sources)  # the host's tensors: captured before save returns

        def run():
            try:
                if event is not None:
                    event.synchronize()
                    copy(sources)
                commit()
            except BaseException as e:  # noqa: BLE001: handed to wait()
                handle._error = e
            finally:
                handle._done.set()

        self._pending = handle
        self._last_step = step
        handle._thread = threading.Thread(target=run, name=f"lockstep-save-{step}")
        handle._thread.start()
        return handle

    def wait(self):
        """Waits for a save made with blocking=False to be committed; raises what failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.wait()
            except BaseException:
                self._last_step = None  # not committed: a save of that step again is not a no-op
                raise

    def _slot_for(self, need):
        """The slot to write next (the older save), mapped and at least `need` bytes."""
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
        return a if a.sequence() <= b.sequence() else b

    @staticmethod
    def _views(slot, layout, data_start, tensors):
        if slot.views is not None and slot.views[0] == layout.key and slot.views[1] == data_start:
            return slot.views[2]
        views = []
        for i, offset, n in layout.entries:
            t = tensors[i][1]
            views.append(torch.frombuffer(slot.map, dtype=t.dtype, count=t.numel(),
                                          offset=data_start + offset).view(t.shape)
                         if n else torch.empty(t.shape, dtype=t.dtype))
        slot.views = (layout.key, data_start, views)
        return views

    # ----------------------------------------------------------------------------------------
    # load

    def load(self, model, optimizer=None):
        """Restores the group's newest common state into `model` (in place) and `optimizer`;
        returns its step, or None when there is none (a fresh start). Sets self.extra."""
        if self._fallback is not None:
            return self._load_fallback(model, optimizer)
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
            self._fill(m, int(response.step), model, optimizer)
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

    def _fill(self, m, step, model, optimizer):
        (n,) = struct.unpack_from("<Q", m, HEADER_BYTES)
        header = json.loads(bytes(m[HEADER_BYTES + 8:HEADER_BYTES + 8 + n]))
        data_start = HEADER_BYTES + 8 + n
        header.pop("__metadata__", None)

        def tensor(name, copy=True):
            if name not in header:
                raise KeyError(f"lockstep.torch.Checkpointer: the checkpoint of step {step} "
                               f"has no tensor {name}")
            e = header[name]
            begin, end = e["data_offsets"]
            dtype = _TORCH_DTYPES[e["dtype"]]
            count = (end - begin) // torch.empty((), dtype=dtype).element_size()
            if count == 0:
                return torch.empty(e["shape"], dtype=dtype)
            view = torch.frombuffer(m, dtype=dtype, count=count,
                                    offset=data_start + begin).view(e["shape"])
            # A copy, unless the caller copies it on: the mapping closes when load returns.
            return view.clone() if copy else view

        rest = pickle.loads(bytes(tensor(_REMAINDER).numpy().tobytes()))

        def build(value):
            if isinstance(value, _Tensor):
                return tensor(value.name)
            if isinstance(value, dict):
                return {k: build(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(build(v) for v in value)
            return value

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
                    # Straight from the mapping into the model's tensor: one copy.
                    src = (tensor(saved[k].name, copy=False) if isinstance(saved[k], _Tensor)
                           else build(saved[k]))
                    if isinstance(dst, torch.Tensor):
                        if tuple(src.shape) != tuple(dst.shape):
                            raise ValueError(
                                f"lockstep.torch.Checkpointer: model.{k} has shape "
                                f"{tuple(dst.shape)}, the checkpoint's {tuple(src.shape)}")
                        dst.copy_(src)
        if optimizer is not None:
            if rest["optimizer"] is None:
                raise KeyError(f"lockstep.torch.Checkpointer: the checkpoint of step {step} "
                               f"holds no optimizer state")
            # Views into the mapping: load_state_dict copies them (torch 1.13 deep-copies its
            # argument); whatever it kept as it was is copied here, before the mapping closes.
            views = {}

            def view(value):
                if isinstance(value, _Tensor):
                    t = tensor(value.name, copy=False)
                    views[t.data_ptr()] = t
                    return t
                if isinstance(value, dict):
                    return {k: view(v) for k, v in value.items()}
                if isinstance(value, (list, tuple)):
                    return type(value)(view(v) for v in value)
                return value

            optimizer.load_state_dict(view(rest["optimizer"]))

            def own(value):
                if torch.is_tensor(value):
                    return value.clone() if value.data_ptr() in views else value
                if isinstance(value, dict):
                    for k in value:
                        value[k] = own(value[k])
                    return value
                if isinstance(value, list):
                    value[:] = [own(v) for v in value]
                    return value
                if isinstance(value, tuple):
                    return type(value)(own(v) for v in value)
                return value

            for p in list(optimizer.state):
                optimizer.state[p] = own(optimizer.state[p])
        self.extra = build(rest["extra"]) if rest["extra"] is not None else None

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

    def _load_fallback(self, model, optimizer):
        path = self._fallback_path()
        if not os.path.exists(path):
            return None
        state = torch.load(path, map_location="cpu")
        if model is not None:
            model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        self.extra = state["extra"]
        self._last_step = int(state["step"])
        return self._last_step


class SaveHandle:
    """A save made with blocking=False: wait() returns once it is committed in the worker's
    memory (and raises what failed); done() says whether it is."""

    def __init__(self, step):
        self.step = step
        self._done = threading.Event()
        self._error = None
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
            raise self._error


def _store_sequence(m, value):
    """The slot's commit sequence in one 8-byte store (struct packs '<Q' byte by byte: a kill
    in between would leave a valid-looking, wrong sequence)."""
    with memoryview(m) as whole, whole[8:16] as field, field.cast("Q") as word:
        word[0] = value


def _program_pb2():
    from lockstep.v1 import program_pb2
    return program_pb2


def _hold_for_test(step):
    """Test hook: with LOCKSTEP_TEST_HOLD_SAVE_AT_STEP=N, the save of step N stops after its
    tensors are copied and before its commit, having created LOCKSTEP_TEST_HOLD_SAVE_FILE."""
    at = os.environ.get("LOCKSTEP_TEST_HOLD_SAVE_AT_STEP")
    if at is None or int(at) != step:
        return
    marker = os.environ.get("LOCKSTEP_TEST_HOLD_SAVE_FILE")
    if marker:
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
    while True:
        time.sleep(1)
