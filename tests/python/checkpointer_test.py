#!/usr/bin/env python3
"""lockstep.torch.Checkpointer in one process, against a stand-in for the worker's agent.

The stand-in serves the two calls the Checkpointer makes on a Unix socket, as the worker does:
CheckpointSlots (two files of the size asked for) and CheckpointRestore (the slot whose commit
sequence is the higher, among those whose payload matches its checksum, as the worker's
agreement would choose for a group of one). What the tests check is the Checkpointer's side:
a state saved (blocking or not) comes back bit for bit after a "restart", so do tied weights
(stored once) and tensors inside objects, a state whose tensors change shape, storage or
contiguity between saves comes back as it was at its last save, a save of the same step is a
no-op, a save cut by kill -9 before its commit is never restored, and bad input gets an error
that names the tensor or the value. The real worker, peers and disk are in
tests/integration/program_test.cc.

Run: PYTHONPATH=BUILD/python checkpointer_test.py  (exit 77: no torch, grpc or xxhash here)
"""
import collections
import ctypes
import importlib
import io
import json
import mmap
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import time
import unittest
from concurrent import futures

try:
    import grpc
    import torch
    import torch.nn as nn
    from torch.utils._pytree import tree_map
    import xxhash
    from lockstep.v1 import program_pb2, program_pb2_grpc
except ImportError as e:  # the dependencies CI installs: a skip here, not a failure
    print(f"skipped: {e}")
    sys.exit(77)

HEADER_BYTES = 4096


def committed(path):
    """(sequence, step) of the slot at `path` when it holds a whole save, else None."""
    with open(path, "rb") as f:
        data = f.read()
    magic, sequence, step, payload, checksum = struct.unpack_from("<8sQqQQ", data, 0)
    if magic != b"LSCKPT01" or sequence == 0 or payload == 0:
        return None
    if xxhash.xxh3_64_intdigest(data[HEADER_BYTES:HEADER_BYTES + payload]) != checksum:
        return None
    return sequence, step, payload


def read(path):
    with open(path, "rb") as f:
        return f.read()


class Agent(program_pb2_grpc.ProgramServiceServicer):
    def __init__(self, dir):
        self.dir = dir
        self.paths = []
        self.restores = []

    def CheckpointSlots(self, request, context):
        if not self.paths or os.path.getsize(self.paths[0]) < request.bytes:
            self.paths = [os.path.join(self.dir, f"job.{i}.slot") for i in range(2)]
            for p in self.paths:
                with open(p, "ab") as f:
                    f.truncate(max(request.bytes, os.path.getsize(p)))
        return program_pb2.CheckpointSlotsResponse(paths=self.paths,
                                                   bytes=os.path.getsize(self.paths[0]))

    def CheckpointRestore(self, request, context):
        if request.loaded:
            self.restores.append(request.step)
            return program_pb2.CheckpointRestoreResponse()
        held = [(committed(p), p) for p in self.paths]
        held = sorted(((c, p) for c, p in held if c is not None), reverse=True)
        if not held:
            return program_pb2.CheckpointRestoreResponse(found=False)
        (sequence, step, payload), path = held[0]
        return program_pb2.CheckpointRestoreResponse(found=True, step=step, path=path,
                                                     payload_bytes=payload, source="memory")


class Box:
    """A user's object in `extra` holding a tensor (pickled by reference: a module-level class)."""

    def __init__(self, tensor, label):
        self.tensor = tensor
        self.label = label


class Kept(Box):
    """An object that deep copies as itself: what it holds must already be the restore's own."""

    def __deepcopy__(self, memo):
        return self


class Nested:
    """An object whose pickling calls `callback` (standing for a signal handler that runs
    while a save is under way)."""

    def __init__(self, callback):
        self.callback = callback

    def __reduce__(self):
        self.callback()
        return Nested, (None,)


class Wrapped(torch.Tensor):
    """A wrapper subclass: a tensor with no storage of its own (data_ptr() is 0), its values
    in `elem`, reached through __torch_dispatch__."""

    @staticmethod
    def __new__(cls, elem):
        wrapped = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                      dtype=elem.dtype, device=elem.device)
        wrapped.elem = elem
        return wrapped

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.elem if isinstance(x, Wrapped) else x
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class Tied(nn.Module):
    """A decoder whose output layer shares the embedding's weight (one tensor, two keys)."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(6, 4)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(self.embed(ids))


def model_and_optimizer(seed=0, out=3):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, out))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def train(model, opt, steps):
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        loss = model(torch.randn(16, 4, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def same_state(test, a_model, a_opt, b_model, b_opt):
    for (k, a), b in zip(a_model.state_dict().items(), b_model.state_dict().values()):
        test.assertTrue(torch.equal(a, b), k)
    sa, sb = a_opt.state_dict(), b_opt.state_dict()
    test.assertEqual(sa["param_groups"], sb["param_groups"])
    for i, state in sa["state"].items():
        for k, v in state.items():
            test.assertTrue(torch.equal(v, sb["state"][i][k]), f"optimizer state {i}.{k}")


class CheckpointerTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.agent = Agent(self.tmp.name)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        program_pb2_grpc.add_ProgramServiceServicer_to_server(self.agent, self.server)
        socket = os.path.join(self.tmp.name, "agent.sock")
        self.server.add_insecure_port(f"unix:{socket}")
        self.server.start()
        os.environ["LOCKSTEP_AGENT_ADDRESS"] = f"unix:{socket}"
        os.environ["LOCKSTEP_AGENT_TOKEN"] = "secret"
        self.lt = self.fresh_process()

    def tearDown(self):
        self.server.stop(None)
        self.tmp.cleanup()
        for k in ("LOCKSTEP_AGENT_ADDRESS", "LOCKSTEP_AGENT_TOKEN"):
            os.environ.pop(k, None)

    @staticmethod
    def fresh_process():
        """lockstep.torch as a restarted process finds it (no channel, no state)."""
        import lockstep._agent
        import lockstep.checkpoint
        import lockstep.torch
        importlib.reload(lockstep._agent)
        importlib.reload(lockstep.checkpoint)
        return importlib.reload(lockstep.torch)

    def test_a_save_comes_back_bit_for_bit_after_a_restart(self):
        for blocking in (True, False):
            with self.subTest(blocking=blocking):
                model, opt = model_and_optimizer()
                ckpt = self.lt.Checkpointer()
                self.assertIsNone(ckpt.load(model, opt))  # nothing saved yet (or the last run's)
                train(model, opt, 3)
                handle = ckpt.save(3, model, opt, extra={"epoch": 1, "note": "x"},
                                   blocking=blocking)
                if not blocking:
                    handle.wait()
                    self.assertTrue(handle.done())
                self.lt = self.fresh_process()
                restored, restored_opt = model_and_optimizer(seed=1)
                again = self.lt.Checkpointer()
                self.assertEqual(again.load(restored, restored_opt), 3)
                same_state(self, model, opt, restored, restored_opt)
                self.assertEqual(again.extra, {"epoch": 1, "note": "x"})
                self.assertEqual(self.agent.restores[-1], 3)
                # Both train on identically from there.
                train(model, opt, 2)
                train(restored, restored_opt, 2)
                same_state(self, model, opt, restored, restored_opt)
                for p in self.agent.paths:
                    os.truncate(p, 0)  # the next round starts with empty memory
                self.agent.paths = []

    def test_a_large_non_blocking_save_is_committed_in_its_thread(self):
        model = nn.Linear(1024, 512)  # 2 MiB: past the size committed inline
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        expected = model.weight.detach().clone()
        handle = ckpt.save(1, model, opt, blocking=False)
        with torch.no_grad():
            model.weight.add_(1.0)  # after save() returned: not in the save
        handle.wait()
        self.lt = self.fresh_process()
        restored = nn.Linear(1024, 512)
        self.assertEqual(self.lt.Checkpointer().load(restored), 1)
        self.assertTrue(torch.equal(restored.weight, expected))

    def test_a_failed_non_blocking_save_is_raised_once(self):
        # A non-blocking save whose commit fails in its thread: handle.wait() raises it, and the
        # next save neither raises it again nor takes its step for saved; not waited for, the
        # next save raises it.
        model, opt = model_and_optimizer()
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        big = torch.zeros(300_000, dtype=torch.float64)  # past 1 MiB: committed in the thread
        ck = sys.modules["lockstep.checkpoint"]
        real = ck._hash_payload

        def fail(slot, length):
            raise OSError("the hash failed")

        ck._hash_payload = fail
        try:
            handle = ckpt.save(1, model, opt, extra={"big": big}, blocking=False)
            with self.assertRaisesRegex(OSError, "the hash failed"):
                handle.wait()
            ckpt.save(2, model, opt, extra={"big": big}, blocking=False)  # fails in its thread
            ckpt._pending._done.wait()  # with `fail` in place (not handle.wait(): it reports)
        finally:
            ck._hash_payload = real
        with self.assertRaisesRegex(OSError, "the hash failed"):
            ckpt.save(3, model, opt, extra={"big": big})  # step 2's failure, not waited for
        ckpt.save(2, model, opt, extra={"big": big})  # not taken for saved
        self.assertEqual(max(filter(None, map(committed, self.agent.paths)))[1], 2)

    def test_a_save_of_the_same_step_is_a_no_op(self):
        model, opt = model_and_optimizer()
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        train(model, opt, 1)
        ckpt.save(1, model, opt)
        before = [committed(p) for p in self.agent.paths]
        train(model, opt, 1)
        ckpt.save(1, model, opt)
        self.assertEqual([committed(p) for p in self.agent.paths], before)

    def test_a_process_killed_inside_a_save_restores_the_save_before(self):
        # A process saves steps 1 and 2, then is killed -9 inside its save of step 3 (its
        # tensors copied, the commit not written: the save's test hook holds it there).
        held = os.path.join(self.tmp.name, "held")
        state_2 = os.path.join(self.tmp.name, "state-2.pt")
        child = subprocess.Popen([sys.executable, "-c", f"""
import os, sys, torch
sys.path[:0] = {sys.path!r}
from checkpointer_test import model_and_optimizer, train
import lockstep.torch as lt
os.environ["LOCKSTEP_TEST_HOLD_SAVE_AT_STEP"] = "3"
os.environ["LOCKSTEP_TEST_HOLD_SAVE_FILE"] = {held!r}
model, opt = model_and_optimizer()
ckpt = lt.Checkpointer()
ckpt.load(None)
for step in (1, 2):
    train(model, opt, 1)
    ckpt.save(step, model, opt)
torch.save(model.state_dict(), {state_2!r})
train(model, opt, 1)
ckpt.save(3, model, opt)
"""], cwd=os.path.dirname(os.path.abspath(__file__)))
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(held) and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            self.assertTrue(os.path.exists(held), "the save of step 3 never reached its hook")
        finally:
            child.kill()
            child.wait()
        self.lt = self.fresh_process()
        restored, restored_opt = model_and_optimizer(seed=1)
        self.assertEqual(self.lt.Checkpointer().load(restored, restored_opt), 2)
        for k, v in torch.load(state_2).items():
            self.assertTrue(torch.equal(v, restored.state_dict()[k]), k)

    def test_tied_weights_and_tensors_inside_objects_come_back(self):
        model = Tied(seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.tensor([1, 2])).sum().backward()
        opt.step()
        box = Box(torch.arange(6.0).view(2, 3), "ema")
        kept = Kept(torch.full((1000,), 2.5), "kept")
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        ckpt.save(1, model, opt, extra={"box": box, "same": box.tensor, "n": 7, "kept": kept})
        # The tied weight is one tensor in the slot, not two (the other [6, 4] is its momentum).
        header = self.slot_header()
        self.assertEqual(sum(1 for e in header.values() if e.get("shape") == [6, 4]), 2)
        self.lt = self.fresh_process()
        restored = Tied(seed=1)
        restored_opt = torch.optim.SGD(restored.parameters(), lr=0.1, momentum=0.9)
        again = self.lt.Checkpointer()
        self.assertEqual(again.load(restored, restored_opt), 1)
        self.assertIs(restored.out.weight, restored.embed.weight)
        same_state(self, model, opt, restored, restored_opt)
        got = again.extra
        self.assertIsInstance(got["box"], Box)
        self.assertEqual(got["box"].label, "ema")
        self.assertTrue(torch.equal(got["box"].tensor, box.tensor))
        self.assertIs(got["same"], got["box"].tensor)  # one tensor in, one tensor out
        self.assertEqual(got["n"], 7)
        # Read after the slot's mapping closed (a view into it would crash this process).
        for p in self.agent.paths:
            os.truncate(p, 0)
        self.assertTrue(torch.equal(got["kept"].tensor, torch.full((1000,), 2.5)))

    def test_an_optimizer_state_that_is_not_a_dict_of_tensors_comes_back(self):
        model, _ = model_and_optimizer()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # its state is left as it is set
        opt.state[next(model.parameters())] = [torch.arange(3.0), 7]  # a list
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        ckpt.save(1, model, opt)
        self.lt = self.fresh_process()
        restored, _ = model_and_optimizer(seed=1)
        restored_opt = torch.optim.SGD(restored.parameters(), lr=0.1)
        self.assertEqual(self.lt.Checkpointer().load(restored, restored_opt), 1)
        got = restored_opt.state[next(iter(restored.parameters()))]
        self.assertTrue(torch.equal(got[0], torch.arange(3.0)))
        self.assertEqual(got[1], 7)

    def saved_trained_state(self):
        model, opt = model_and_optimizer()
        train(model, opt, 2)
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        ckpt.save(2, model, opt)
        self.lt = self.fresh_process()
        return model, opt

    def test_an_optimizer_that_keeps_the_state_it_loads_gets_copies(self):
        # An optimizer whose load_state_dict is not torch's own, in its class or on the object,
        # may keep what it is given, anywhere: it gets copies (views would point into the
        # mapping, unmapped when load returns: reading them crashes).
        def keep(optimizer, state_dict):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            optimizer.kept = {params[i]: s for i, s in state_dict["state"].items()}

        class Keeping(torch.optim.AdamW):
            load_state_dict = keep

        model, opt = self.saved_trained_state()
        for how in ("class", "object"):
            restored, _ = model_and_optimizer(seed=1)
            if how == "class":
                keeping = Keeping(restored.parameters(), lr=0.01)
            else:
                keeping = torch.optim.AdamW(restored.parameters(), lr=0.01)
                keeping.load_state_dict = lambda state_dict, o=keeping: keep(o, state_dict)
            self.assertEqual(self.lt.Checkpointer().load(restored, keeping), 2, how)
            for p, q in zip(model.parameters(), restored.parameters()):
                for k, v in opt.state[p].items():
                    self.assertTrue(torch.equal(v, keeping.kept[q][k]), f"{how}: {k}")
            self.assertEqual(keeping.param_groups[0]["lr"], 0.01)

    def test_views_torch_keeps_since_2_1_are_copied_out_of_the_mapping(self):
        # torch.optim's own load_state_dict gets views of the mapping. Before torch 2.1 it
        # deep-copies them; since 2.1 (pytorch#106082) it keeps a tensor as given when its dtype
        # and device match, so load copies out what it kept. Here 2.1's way stands in for 1.13's,
        # and the mappings load makes are watched: no state tensor may point into one.
        def shallow(optimizer, state_dict):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            state = collections.defaultdict(dict)
            for i, s in state_dict["state"].items():
                p = params[i]
                state[p] = {k: v if k == "step" else v.to(dtype=p.dtype, device=p.device)
                            for k, v in s.items()}
            groups = [dict(saved, params=g["params"])
                      for saved, g in zip(state_dict["param_groups"], optimizer.param_groups)]
            optimizer.__setstate__({"state": state, "param_groups": groups})

        class Mappings:
            def __init__(self, real):
                self.real, self.ranges = real, []

            def __getattr__(self, name):
                return getattr(self.real, name)

            def mmap(self, *args, **kwargs):
                m = self.real.mmap(*args, **kwargs)
                if kwargs.get("access") == self.real.ACCESS_COPY:  # load's
                    begin = torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
                    self.ranges.append((begin, begin + len(m)))
                return m

        model, opt = self.saved_trained_state()
        ck = sys.modules["lockstep.checkpoint"]
        restored, restored_opt = model_and_optimizer(seed=1)
        own = torch.optim.Optimizer.load_state_dict
        ck.mmap = mappings = Mappings(mmap)
        torch.optim.Optimizer.load_state_dict = shallow
        try:
            self.assertEqual(self.lt.Checkpointer().load(restored, restored_opt), 2)
        finally:
            torch.optim.Optimizer.load_state_dict = own
            ck.mmap = mmap
        self.assertEqual(len(mappings.ranges), 1)
        (begin, end), = mappings.ranges
        for q, state in restored_opt.state.items():
            for k, v in state.items():
                self.assertFalse(begin <= v.data_ptr() < end, f"{k} points into the mapping")
        same_state(self, model, opt, restored, restored_opt)
        train(restored, restored_opt, 1)

    def test_a_state_that_changes_shape_between_saves_comes_back_in_its_last_shape(self):
        model, opt = model_and_optimizer()
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        buffer = torch.zeros(3)
        ckpt.save(1, model, opt, extra={"buffer": buffer})
        buffer.resize_(5).copy_(torch.arange(5.0))  # the same tensor, grown in place
        ckpt.save(2, model, opt, extra={"buffer": buffer})
        train(model, opt, 1)
        buffer.add_(1.0)
        ckpt.save(3, model, opt, extra={"buffer": buffer, "ids": torch.tensor([4, 5])})
        self.lt = self.fresh_process()
        restored, restored_opt = model_and_optimizer(seed=1)
        again = self.lt.Checkpointer()
        self.assertEqual(again.load(restored, restored_opt), 3)
        same_state(self, model, opt, restored, restored_opt)
        self.assertTrue(torch.equal(again.extra["buffer"], torch.arange(5.0) + 1))
        self.assertTrue(torch.equal(again.extra["ids"], torch.tensor([4, 5])))

    def test_a_tensor_replaced_or_not_contiguous_is_saved_as_it_is_now(self):
        # Saves after the first reuse the tensors' flat views while each is where it was;
        # a parameter given new storage of the same shape, or a tensor that is not
        # contiguous, must still be saved from what it holds at the save.
        model, opt = model_and_optimizer()
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        grid = torch.arange(12.0).view(3, 4)
        ckpt.save(1, model, opt, extra={"grid": grid})
        with torch.no_grad():
            model[0].weight.data = model[0].weight.data + 1.0  # same shape, new storage
        ckpt.save(2, model, opt, extra={"grid": grid})
        ckpt.save(3, model, opt, extra={"grid": grid.t()})  # a strided view
        grid.mul_(2.0)
        ckpt.save(4, model, opt, extra={"grid": grid.t()})
        self.lt = self.fresh_process()
        restored, restored_opt = model_and_optimizer(seed=1)
        again = self.lt.Checkpointer()
        self.assertEqual(again.load(restored, restored_opt), 4)
        same_state(self, model, opt, restored, restored_opt)
        self.assertTrue(torch.equal(again.extra["grid"], (torch.arange(12.0).view(3, 4) * 2).t()))

    def test_the_same_tensors_changed_in_place_are_saved_as_they_are_now(self):
        # A save whose tensors are the objects of the save before, at the same addresses,
        # skips the checks and the layout made then (_Placed, _HostCopy). A tensor may have
        # changed under them: shrunk in place (the same address, another shape), or given
        # another dtype over the same memory. The same tensors put under other keys must come
        # back under those (a save keeps no keys: this guards that).
        model, _ = model_and_optimizer()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        first = next(model.parameters())
        x, y = torch.full((3,), 1.0), torch.full((3,), 2.0)
        opt.state[first] = {"b": x, "a": y}
        shrunk = torch.arange(6.0)
        retyped = torch.zeros(4)
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        ckpt.save(1, model, opt, extra={"shrunk": shrunk, "retyped": retyped})
        kept = ckpt._flat
        self.assertIsNotNone(kept)
        ckpt.save(2, model, opt, extra={"shrunk": shrunk, "retyped": retyped})
        self.assertIs(ckpt._flat, kept, "the second save did not take the kept way")
        address = (shrunk.data_ptr(), retyped.data_ptr())
        shrunk.resize_(4)
        retyped.data = retyped.data.view(torch.int32)
        retyped.copy_(torch.tensor([7, -1, 1 << 30, 3], dtype=torch.int32))
        opt.state[first] = {"a": x, "b": y}  # the same tensors in the same order
        self.assertEqual((shrunk.data_ptr(), retyped.data_ptr()), address)
        ckpt.save(3, model, opt, extra={"shrunk": shrunk, "retyped": retyped})
        self.lt = self.fresh_process()
        restored, _ = model_and_optimizer(seed=1)
        restored_opt = torch.optim.SGD(restored.parameters(), lr=0.1)
        again = self.lt.Checkpointer()
        self.assertEqual(again.load(restored, restored_opt), 3)
        self.assertTrue(torch.equal(again.extra["shrunk"], torch.arange(4.0)))
        got = again.extra["retyped"]
        self.assertEqual(got.dtype, torch.int32)
        self.assertEqual(got.tolist(), [7, -1, 1 << 30, 3])
        state = restored_opt.state[next(restored.parameters())]
        self.assertEqual((state["a"].tolist(), state["b"].tolist()), ([1.0] * 3, [2.0] * 3))

    def test_the_native_copy_and_its_fallback_write_the_same_slots(self):
        # The copy of liblockstep_checkpoint.so (the build puts it in the package) against the
        # one a package without it makes (torch.cat, the xxhash module): the same slots, byte
        # for byte, after each save of a run whose state changes storage, contiguity and
        # tensors, with five dtypes, an empty tensor and one larger than the native copy's
        # 256 KiB window.
        def run(native):
            os.environ["LOCKSTEP_CHECKPOINT_NATIVE"] = native
            try:
                lt = self.fresh_process()
            finally:
                del os.environ["LOCKSTEP_CHECKPOINT_NATIVE"]
            gather = sys.modules["lockstep.checkpoint"]._GATHER
            self.assertEqual(gather is not None, native == "1", "the build's package has no "
                             "liblockstep_checkpoint.so" if native == "1" else "not turned off")
            model, opt = model_and_optimizer()
            ckpt = lt.Checkpointer()
            ckpt.load(None)
            big = torch.arange(100_000, dtype=torch.float64)  # 800 KB
            extra = {"big": big, "ids": torch.tensor([1, 2, 3], dtype=torch.int16),
                     "flags": torch.tensor([True, False, True]), "empty": torch.empty(0)}
            slots = []
            for step in range(1, 7):
                train(model, opt, 1)
                big.mul_(1.5)
                if step == 3:
                    with torch.no_grad():
                        model[0].weight.data = model[0].weight.data + 1.0  # new storage
                if step == 4:
                    extra["grid"] = torch.arange(12.0).view(3, 4).t()  # not contiguous
                if step == 5:
                    del extra["grid"]
                if step == 6:
                    extra["more"] = torch.ones(300_000, dtype=torch.float64)  # past 1 MiB:
                handle = ckpt.save(step, model, opt, extra=extra,
                                   blocking=step < 6)  # hashed in the thread
                if handle is not None:
                    handle.wait()
                self.assertEqual(max(filter(None, map(committed, self.agent.paths)))[1], step)
                slots.append([read(p) for p in self.agent.paths])
            for p in self.agent.paths:
                os.truncate(p, 0)
            self.agent.paths = []
            return slots

        native, fallback = run("1"), run("0")
        for step, (a, b) in enumerate(zip(native, fallback), 1):
            self.assertTrue(a == b, f"the slots differ after the save of step {step}")

    def test_the_native_copy_hashes_what_it_copied_and_copies_nothing_out_of_place(self):
        gather = sys.modules["lockstep.checkpoint"]._GATHER
        self.assertIsNotNone(gather, "the build's package has no liblockstep_checkpoint.so")
        payload = (ctypes.c_ubyte * (600 << 10))()
        base = ctypes.addressof(payload)
        a = bytes(range(256)) * 400  # 100 KiB
        b = bytes(reversed(range(256))) * 1200  # 300 KiB: across windows
        buffers = [ctypes.create_string_buffer(a, len(a)), ctypes.create_string_buffer(b, len(b))]
        srcs = (ctypes.c_uint64 * 2)(*map(ctypes.addressof, buffers))
        sizes = (ctypes.c_uint64 * 2)(len(a), len(b))
        dsts = (ctypes.c_uint64 * 2)(base + 1000, base + 250_000)  # gaps before, between, after
        checksum = ctypes.c_uint64()
        self.assertEqual(gather(2, srcs, dsts, sizes, base, len(payload), checksum), 0)
        data = bytes(payload)
        self.assertEqual(data[1000:1000 + len(a)], a)
        self.assertEqual(data[250_000:250_000 + len(b)], b)
        self.assertEqual(data[:1000] + data[1000 + len(a):250_000], bytes(250_000 - len(a)))
        self.assertEqual(checksum.value, xxhash.xxh3_64_intdigest(data))
        # Without a checksum it only copies.
        ctypes.memset(payload, 0, len(payload))
        self.assertEqual(gather(2, srcs, dsts, sizes, base, len(payload), None), 0)
        self.assertEqual(bytes(payload), data)
        # Destinations out of order, or past the payload's end: -1, and nothing copied.
        small = (ctypes.c_ubyte * 1000)()
        at = ctypes.addressof(small)
        twenty = (ctypes.c_uint64 * 2)(20, 20)
        for where, what in (((at + 500, at + 100), "out of order"),
                            ((at, at + 990), "past the end"),
                            ((at, at + 2000), "beyond the end")):
            self.assertEqual(gather(2, srcs, (ctypes.c_uint64 * 2)(*where), twenty, at, 1000,
                                    checksum), -1, what)
            self.assertEqual(bytes(small), bytes(1000), what)
        # A null source of some bytes (a tensor without memory of its own): -1, nothing copied.
        null = (ctypes.c_uint64 * 2)(srcs[0], 0)
        self.assertEqual(gather(2, null, (ctypes.c_uint64 * 2)(at, at + 100), twenty, at, 1000,
                                checksum), -1)
        self.assertEqual(bytes(small), bytes(1000))

    def test_tensors_whose_memory_is_not_what_they_read_are_saved_as_they_read(self):
        # A negative view (its memory holds the negated values), a zero tensor (no memory) and
        # a wrapper subclass (no storage of its own) are contiguous, and the native copy would
        # copy their memory; torch.cat resolves them. A negative view of a tensor saved before
        # has that tensor's address: the kept addresses must not be reused for it.
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        model = nn.Linear(2, 2)
        plain = torch.tensor([1.0, -2.0, 3.0])
        ckpt.save(1, model, extra={"x": plain})
        state = {"x": torch._neg_view(plain), "imag": torch.tensor([1 + 2j]).conj().imag,
                 "zeros": torch._efficientzerotensor(4), "wrapped": Wrapped(torch.arange(4.0))}
        self.assertEqual(state["x"].data_ptr(), plain.data_ptr())
        ckpt.save(2, model, extra=state)
        self.lt = self.fresh_process()
        again = self.lt.Checkpointer()
        self.assertEqual(again.load(nn.Linear(2, 2)), 2)
        got = again.extra
        self.assertEqual(got["x"].tolist(), [-1.0, 2.0, -3.0])
        self.assertEqual(got["imag"].tolist(), [-2.0])
        self.assertEqual(got["zeros"].tolist(), [0.0] * 4)
        self.assertEqual(got["wrapped"].tolist(), [0.0, 1.0, 2.0, 3.0])

    def test_a_save_inside_a_save_is_refused_and_the_next_save_works(self):
        # A save that starts inside another (a signal handler's, here an object's __reduce__)
        # would share the pickler and the slot being written: it is refused, clearly.
        model, opt = model_and_optimizer()
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        nested = Nested(lambda: ckpt.save(2, model, opt))
        with self.assertRaisesRegex(RuntimeError, r"Checkpointer\.save: called inside a save"):
            ckpt.save(1, model, opt, extra={"nested": nested})
        ckpt.save(1, model, opt, extra={"epoch": 3})
        self.lt = self.fresh_process()
        restored, restored_opt = model_and_optimizer(seed=1)
        again = self.lt.Checkpointer()
        self.assertEqual(again.load(restored, restored_opt), 1)
        same_state(self, model, opt, restored, restored_opt)
        self.assertEqual(again.extra, {"epoch": 3})

    def slot_header(self):
        """The safetensors header of the newest committed slot."""
        path = max((committed(p), p) for p in self.agent.paths if committed(p))[1]
        with open(path, "rb") as f:
            data = f.read()
        (n,) = struct.unpack_from("<Q", data, HEADER_BYTES)
        return json.loads(data[HEADER_BYTES + 8:HEADER_BYTES + 8 + n])

    def test_bad_input_names_the_tensor_or_the_value(self):
        model, opt = model_and_optimizer()
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        with self.assertRaisesRegex(ValueError, r"extra\.blob .*keep large values in tensors"):
            ckpt.save(1, model, opt, extra={"blob": b"x" * (65 << 20)})
        with self.assertRaisesRegex(TypeError, r"extra\.grid is a sparse"):
            ckpt.save(1, model, opt, extra={"grid": torch.eye(3).to_sparse()})
        with self.assertRaisesRegex(TypeError, r"extra\.c is a torch.complex64 tensor"):
            ckpt.save(1, model, opt, extra={"c": torch.zeros(2, dtype=torch.complex64)})
        ckpt.save(1, model, opt)
        self.lt = self.fresh_process()
        wider, wider_opt = model_and_optimizer(out=5)
        with self.assertRaisesRegex(ValueError, r"model\.2\.weight has shape \(5, 8\), the "
                                                r"checkpoint's \(3, 8\)"):
            self.lt.Checkpointer().load(wider, wider_opt)
        self.lt = self.fresh_process()
        with self.assertRaisesRegex(KeyError, r"model\.2\.weight is not in the model"):
            bigger = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
            self.lt.Checkpointer().load(bigger)

    def pretend_saved_on(self, devices):
        """Rewrites the newest committed slot as a save on another host would have written it:
        the tensor of each shape in `devices` recorded on its device (a host with GPUs records
        where each tensor off the host was)."""
        (sequence, step, payload), path = max((committed(p), p) for p in self.agent.paths
                                              if committed(p))
        data = read(path)
        (n,) = struct.unpack_from("<Q", data, HEADER_BYTES)
        header = json.loads(data[HEADER_BYTES + 8:HEADER_BYTES + 8 + n])
        where = {name: devices[tuple(e["shape"])] for name, e in header.items()
                 if name != "__metadata__" and tuple(e["shape"]) in devices}
        self.assertEqual({tuple(header[name]["shape"]) for name in where}, set(devices))
        header["__metadata__"]["devices"] = json.dumps(where)
        text = json.dumps(header).encode()
        text += b" " * ((-(HEADER_BYTES + 8 + len(text))) % 64)
        body = struct.pack("<Q", len(text)) + text + data[HEADER_BYTES + 8 + n:HEADER_BYTES +
                                                          payload]
        top = bytearray(data[:HEADER_BYTES])
        struct.pack_into("<QQ", top, 24, len(body), xxhash.xxh3_64_intdigest(body))
        with open(path, "wb") as f:
            f.write(bytes(top) + body)

    def test_tensors_saved_off_the_host_come_back_on_a_device_of_their_kind(self):
        model, opt = model_and_optimizer()
        train(model, opt, 2)
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        ema = torch.arange(35.0).view(5, 7)
        ckpt.save(2, model, opt, extra={"ema": ema, "box": Box(torch.ones(3, 2), "b")})
        self.assertNotIn("devices", self.slot_header()["__metadata__"])  # all on the host
        self.pretend_saved_on({(5, 7): "cuda:1"})

        # A tensor saved on a GPU goes to this process's GPU (not necessarily cuda:1: a
        # restarted rank may have another); with none here, an error that names it.
        self.lt = self.fresh_process()
        restored, restored_opt = model_and_optimizer(seed=1)
        if torch.cuda.is_available():
            again = self.lt.Checkpointer()
            self.assertEqual(again.load(restored, restored_opt), 2)
            self.assertEqual(again.extra["ema"].device,
                             torch.device("cuda", torch.cuda.current_device()))
        else:
            with self.assertRaisesRegex(RuntimeError, r"extra\.ema of the checkpoint of step 2 "
                                                      r"was saved on cuda:1, and this process "
                                                      r"has no cuda device; .*map_location"):
                self.lt.Checkpointer().load(restored, restored_opt)
        # map_location puts every tensor outside the model there.
        self.lt = self.fresh_process()
        restored, restored_opt = model_and_optimizer(seed=1)
        again = self.lt.Checkpointer()
        with self.assertRaisesRegex(ValueError, r"map_location 'gpu0' is not a device"):
            again.load(restored, restored_opt, map_location="gpu0")
        self.assertEqual(again.load(restored, restored_opt, map_location="cpu"), 2)
        same_state(self, model, opt, restored, restored_opt)
        self.assertTrue(torch.equal(again.extra["ema"], ema))
        self.assertEqual(again.extra["box"].tensor.device.type, "cpu")

        # A tensor saved on another kind of device goes back to one of that kind (here the
        # meta device, which every build has: a shape without memory), inside an object too.
        self.pretend_saved_on({(3, 2): "meta"})
        self.lt = self.fresh_process()
        restored, restored_opt = model_and_optimizer(seed=1)
        again = self.lt.Checkpointer()
        self.assertEqual(again.load(restored, restored_opt), 2)
        same_state(self, model, opt, restored, restored_opt)
        self.assertEqual(again.extra["box"].tensor.device.type, "meta")
        self.assertEqual(again.extra["box"].tensor.shape, (3, 2))
        self.assertTrue(torch.equal(again.extra["ema"], ema))  # saved on the host: there
    @unittest.skipIf(torch.cuda.is_available(), "a host without a GPU restores it")
    def test_a_gpu_hosts_model_and_optimizer_restore_on_a_host_without_one(self):
        # The model's tensors are filled in place, wherever they were saved, its state dict
        # pickled (tied weights) or not; the optimizer's per-parameter states go to their
        # parameters (torch's load_state_dict), and a "step" saved on a GPU stays on the host
        # where there is none. Only tensors load itself puts somewhere need a device.
        model = Tied(seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.tensor([1, 2])).sum().backward()
        opt.step()
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        ckpt.save(1, model, opt)
        self.pretend_saved_on({(6, 4): "cuda:1"})  # the tied weight and its momentum
        self.lt = self.fresh_process()
        restored = Tied(seed=1)
        restored_opt = torch.optim.SGD(restored.parameters(), lr=0.1, momentum=0.9)
        self.assertEqual(self.lt.Checkpointer().load(restored, restored_opt), 1)
        same_state(self, model, opt, restored, restored_opt)

        model, opt = model_and_optimizer()
        train(model, opt, 2)
        self.lt = self.fresh_process()
        ckpt = self.lt.Checkpointer()
        ckpt.load(None)
        ckpt.save(3, model, opt)
        # A weight, its moments and every "step" (and the model's num_batches_tracked).
        self.pretend_saved_on({(8, 4): "cuda:0", (): "cuda:0"})
        self.lt = self.fresh_process()
        restored, restored_opt = model_and_optimizer(seed=1)
        self.assertEqual(self.lt.Checkpointer().load(restored, restored_opt), 3)
        same_state(self, model, opt, restored, restored_opt)
        self.assertEqual({t.device.type for s in restored_opt.state.values()
                          for t in s.values()}, {"cpu"})


class FormatOneTest(unittest.TestCase):
    def test_a_remainder_of_format_1_loads_as_it_did(self):
        # Checkpoints written before format 2 (a disk may keep them past an upgrade) pickled
        # the dicts that went as their keys as placeholder objects, checkpoint._Dict (the
        # model's state dict: views) and checkpoint._Dicts (the optimizer's states: copies).
        ck = importlib.import_module("lockstep.checkpoint")

        class _Dict(tuple):
            pass

        class _Dicts(tuple):
            pass

        for kind in (_Dict, _Dicts):
            kind.__module__, kind.__qualname__ = ck.__name__, kind.__name__
            setattr(ck, kind.__name__, kind)
        try:
            out = io.BytesIO()
            pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
            pickler.dispatch_table = {k: (lambda o: (type(o), tuple(o))) for k in (_Dict, _Dicts)}
            pickler.dump({"model": _Dict((("w", "b"), 0)),
                          "optimizer": {"state": _Dicts(((0, 1), (("exp_avg", "step"), ("m",)),
                                                         2)),
                                        "param_groups": [{"lr": 0.5, "params": [0, 1]}]},
                          "extra": {"grid": ck._Tensor("5"), "epoch": 3}})
        finally:
            del ck._Dict, ck._Dicts
        rest = ck._Unpickler(out.getvalue(), view=lambda name: f"view {name}",
                             own=lambda name: f"own {name}",
                             state=lambda name, key: f"own {name}").load()
        self.assertEqual(rest, {
            "model": {"w": "view 0", "b": "view 1"},
            "optimizer": {"state": {0: {"exp_avg": "own 2", "step": "own 3"}, 1: {"m": "own 4"}},
                          "param_groups": [{"lr": 0.5, "params": [0, 1]}]},
            "extra": {"grid": "own 5", "epoch": 3}})


class OutsideLockstepTest(unittest.TestCase):
    def setUp(self):
        for k in ("LOCKSTEP_AGENT_ADDRESS", "LOCKSTEP_AGENT_TOKEN"):
            os.environ.pop(k, None)
        self.lt = CheckpointerTest.fresh_process()

    def test_outside_a_job_it_says_so_or_falls_back_to_torch_save(self):
        with self.assertRaisesRegex(RuntimeError, r"not running under a Lockstep worker.*"
                                                  r"fallback_dir"):
            self.lt.Checkpointer()
        with tempfile.TemporaryDirectory() as d:
            model, opt = model_and_optimizer()
            ckpt = self.lt.Checkpointer(fallback_dir=d)
            self.assertIsNone(ckpt.load(model, opt))
            train(model, opt, 2)
            ckpt.save(2, model, opt, extra={"epoch": 0})
            self.assertTrue(os.path.exists(os.path.join(d, "checkpoint-rank0.pt")))
            restored, restored_opt = model_and_optimizer(seed=1)
            again = self.lt.Checkpointer(fallback_dir=d)
            self.assertEqual(again.load(restored, restored_opt), 2)
            same_state(self, model, opt, restored, restored_opt)
            self.assertEqual(again.extra, {"epoch": 0})
            # A tensor of `extra` comes back where it was saved, or where map_location says.
            ckpt.save(3, model, opt, extra={"ema": torch.ones(2)})
            again = self.lt.Checkpointer(fallback_dir=d)
            self.assertEqual(again.load(None, map_location="meta"), 3)
            self.assertEqual(again.extra["ema"].device.type, "meta")


if __name__ == "__main__":
    unittest.main(verbosity=2)
