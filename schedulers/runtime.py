"""Helpers every scheduler shares at plan and launch time: sizes rounded to powers of
two, grid sizes, how tensors are handed to a kernel (fp8 and fp4 as bytes; TMA
tensor descriptors: ``schedulers.tma_tensors``), kernels launched straight to their
compiled launcher (in clusters too), and the interpreter running a launch's programs
concurrently (``schedulers.occupancy``: how many programs a device holds at once).

Nothing here imports Triton at module level: importing Triton before
``TRITON_INTERPRET`` is set (the tests set it at collection) would leave the
interpreter unable to run Triton's own jit functions.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import sys
import threading
import time
from collections.abc import Callable

import torch

from schedulers.tma_tensors import Descriptors, TmaTensor, triton_arguments


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET``) rather than
    compiling them."""
    from triton import knobs  # imported here: see the module's docstring

    return bool(knobs.runtime.interpret)


def next_power_of_two(value: int) -> int:
    """The smallest power of two at least ``value`` (1 for ``value`` <= 1)."""
    return 1 << max(0, (value - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up: programs of ``b`` elements that cover ``a``."""
    return -(-a // b)


# Tensors of these dtypes are read and written by kernels as their byte codes.
BYTE_CODED = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """fp8 and fp4 tensors are read and written as their byte codes."""
    if tensor.dtype in BYTE_CODED:
        return tensor.view(torch.uint8)
    return tensor


def contiguous_strides(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``, in elements."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


@functools.cache
def allocator(device: torch.device) -> Callable[[tuple, tuple, torch.dtype], torch.Tensor]:
    """``allocate(shape, strides, dtype)``: an uninitialized tensor on ``device``
    (``shape`` and ``strides`` tuples, the strides worked out once:
    ``contiguous_strides``). Through the C++ entry that torch.compile's generated code
    allocates with where there is one: torch.empty's parsing of its arguments took 3.3
    us of an H200 host's time an allocation, as long as the allocation itself. That
    entry allocates on the current CUDA device and fills nothing: a call where
    ``device`` is not the current one, or where deterministic algorithms want new
    memory filled (``torch.use_deterministic_algorithms``: NaN shows a kernel that left
    its output unwritten), goes through ``torch.empty_strided``."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    fast = getattr(guards, f"_empty_strided_{device.type}", None)
    index = device.index if device.type == "cuda" else None
    current = torch.cuda.current_device if index is not None else None
    deterministic = torch.are_deterministic_algorithms_enabled

    def allocate(shape: tuple, strides: tuple, dtype: torch.dtype) -> torch.Tensor:
        if fast is None or deterministic() or (current is not None and current() != index):
            return torch.empty_strided(shape, strides, dtype=dtype, device=device)
        return fast(shape, strides, dtype)

    return allocate


class BoundKernel:
    """A generated kernel with its compile-time arguments bound (``keywords``: its
    ``tl.constexpr`` values, ``num_warps``, compile options), launched as
    ``bound(grid, *arguments)`` with the runtime arguments alone.

    Triton's ``JITFunction`` works out at every launch what its compiled kernel is keyed
    by (binding the arguments, their specialization, a cache key): 12-25 us of host
    time a launch on H200 hosts, against 7-16 launched here. Here the first launch of
    each specialization goes through the ``JITFunction`` (which compiles or finds the
    kernel) and later ones go to its compiled launcher's entry directly (``_direct``:
    CUDA tensors as their addresses, tensor descriptors encoded once). Launches share a
    compiled kernel only where Triton's own would: the key here (``specialization``)
    holds everything Triton specializes on and more. Always through the
    ``JITFunction``: a Triton whose compiled kernels' launch this was not written
    against (``DIRECT_LAUNCH_TRITON``), Triton's interpreter, a launch hook (a
    profiler's), a kernel that is not a ``JITFunction`` (a test's stand-in) or one
    whose ``tl.constexpr`` arguments are not its last, all given in ``keywords``.

    With ``cluster`` > 1 the programs are launched in thread-block clusters of that many
    consecutive ones (the grid counts programs), the kernel declaring ``shared`` bytes
    of static shared memory of its own beside the compiler's (dynamic): always straight
    to the compiled kernel, loaded to allow both, not through the ``JITFunction`` (whose
    launch knows no clusters; launch hooks are not called); on the interpreter, through
    it, one program after another.

    Example::

        bound = BoundKernel(kernel, {"BLOCK": 1024, "num_warps": 4})
        bound((cdiv(numel, 1024),), x, y, numel)  # kernel[grid](x, y, numel, BLOCK=1024, ...)
    """

    def __init__(self, kernel, keywords: dict, cluster: int = 1, shared: int = 0) -> None:
        import triton  # see the module's docstring
        from triton import knobs
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        self.kernel, self.keywords = kernel, keywords
        self.driver, self.knobs = driver, knobs  # read at every launch, as Triton does
        self.tail: list | None = None  # the constexprs' values, in the kernel's order
        self.compiled: dict[tuple, tuple] = {}  # by specialization: what a launch takes
        if isinstance(kernel, JITFunction) and direct_launches():
            flags = [param.is_constexpr for param in kernel.params]
            first = flags.index(True) if True in flags else len(flags)
            names = kernel.arg_names[first:]
            runtime = set(kernel.arg_names[:first])  # passed by position only
            if (
                all(flags[first:])
                and all(name in keywords for name in names)
                and not (runtime & set(keywords))
            ):
                self.tail = [keywords[name] for name in names]
        self.cluster = 1 if interpreted() else cluster
        self.shared = shared
        if self.cluster > 1 and self.tail is None:
            raise ValueError(
                f"{getattr(kernel, '__name__', kernel)}: a launch in clusters goes straight "
                f"to the compiled kernel, which needs Triton {' or '.join(DIRECT_LAUNCH_TRITON)}"
                " (this one: " + triton.__version__ + ") and every constexpr, last, bound"
            )

    def __call__(self, grid: tuple, *arguments) -> None:
        self._launch(grid, arguments, (), ())

    def with_scalars(self, *scalars) -> Callable[..., None]:
        """``launch(grid, *tensors)``: ``self(grid, *tensors, *scalars)``, with what the
        trailing ``scalars`` add to the compiled kernel's key (``specialization``)
        worked out once: a launch bound to its shapes passes the same ones every time."""
        try:
            keys = tuple(specialization(scalar) for scalar in scalars)
        except TypeError:  # a scalar of a type not keyed here: keyed at each launch
            return lambda grid, *tensors: self(grid, *tensors, *scalars)
        return lambda grid, *tensors: self._launch(grid, tensors, scalars, keys)

    def _launch(self, grid: tuple, arguments: tuple, scalars: tuple, keys: tuple) -> None:
        """Launches with ``arguments`` then ``scalars``, whose keys are ``keys``."""
        key, passed = self._key(arguments, scalars, keys)
        arguments = (*arguments, *scalars)
        found = self.compiled.get(key) if key is not None else None
        if self.cluster > 1:
            if grid[0] % self.cluster or any(extent != 1 for extent in grid[1:]):
                raise ValueError(f"a grid of {grid} programs is not made of clusters of "
                                 f"{self.cluster} along its first axis")  # fmt: skip
            if key is None:
                raise ValueError(
                    f"{self.kernel.__name__}: arguments of a type not keyed here "
                    "(``specialization``) are not launched in clusters"
                )
            if found is None:
                found = self.compiled[key] = self._load_clustered(self.warmup(grid, *arguments),
                                                                  key[0])  # fmt: skip
        elif found is None:  # the JITFunction compiles the kernel, or finds it compiled
            compiled = self.kernel[grid](*triton_arguments(arguments), **self.keywords)
            if key is not None:
                self.compiled[key] = _direct(compiled, compiled.packed_metadata)
            return
        launch, function, head, descriptors = found
        if descriptors is not None:
            passed = descriptors(passed)
        launch(grid[0] // self.cluster, grid[1] if len(grid) > 1 else 1,
               grid[2] if len(grid) > 2 else 1, self.driver.active.get_current_stream(key[0]),
               function, *head, *passed, *self.tail)  # fmt: skip

    def resident_clusters(self, grid: tuple, *arguments) -> int:
        """How many of this kernel's clusters, launched as ``bound(grid, *arguments)``
        launches them, the device holds at once (``occupancy.max_active_clusters``;
        loaded, compiled if need be, not launched). A persistent grid of more runs the
        rest in a second wave."""
        from schedulers.occupancy import max_active_clusters  # it imports this module

        key, _ = self._key(arguments)
        if self.cluster == 1 or key is None:
            raise ValueError(f"{getattr(self.kernel, '__name__', self.kernel)}: not launched "
                             "in clusters here")  # fmt: skip
        compiled = self.warmup(grid, *arguments)
        if key not in self.compiled:
            self.compiled[key] = self._load_clustered(compiled, key[0])
        # the compiled kernel's threads and dynamic shared memory, as a launch takes them
        metadata = compiled.metadata
        return max_active_clusters(self.compiled[key][1], metadata.num_warps * 32,
                                   metadata.shared, self.cluster)  # fmt: skip

    def warmup(self, grid: tuple, *arguments):
        """The compiled kernel ``bound(grid, *arguments)`` launches, compiled now if need
        be, not launched (the ``JITFunction``'s ``warmup``, TMA tensors handed over as
        Triton's descriptors)."""
        return self.kernel.warmup(*triton_arguments(arguments), grid=grid, **self.keywords)

    def _load_clustered(self, compiled, device: int) -> tuple:
        """``compiled`` (this kernel's, not launched) loaded again allowing ``shared``
        bytes more (``OutOfResources`` past the device's most): its launch in clusters."""
        metadata = compiled.metadata
        if metadata.global_scratch_size or metadata.profile_scratch_size or (
                metadata.num_ctas != 1):  # fmt: skip
            raise ValueError(f"{compiled.name}: scratch memory or CTAs of its own: "
                             "not launched in clusters here")  # fmt: skip
        # Triton's launcher (its own load of the kernel, checked), given the cluster's
        # launch metadata
        launch, _, head, descriptors = _direct(
            compiled, (metadata.num_warps, self.cluster, metadata.shared)
        )
        utils, shared = self.driver.active.utils, metadata.shared + self.shared
        most = utils.get_device_properties(device)["max_shared_mem"]
        if shared > most:
            from triton.runtime.errors import OutOfResources  # see the module's docstring

            raise OutOfResources(shared, most, "shared memory")
        # loaded for its dynamic and static shared memory together: Triton's loader then
        # allows the dynamic part past the default 48 KiB where the two pass it
        _, function, *_ = utils.load_binary(compiled.name, compiled.kernel, shared, device)
        return launch, function, head, descriptors

    def _key(self, arguments: tuple, scalars: tuple = (),
             keys: tuple = ()) -> tuple[tuple | None, list | tuple]:  # fmt: skip
        """The compiled kernel's key for ``arguments`` then ``scalars`` (whose keys are
        ``keys``; its device first; None where the launch keeps to the JITFunction's
        path), and the arguments its compiled launcher is given: a CUDA tensor as its
        address, which the launcher would otherwise ask the tensor and then the driver
        for (2.6 us of an H200 host's time a launch of 10 tensors); anything else as it
        is (a CPU tensor: the launcher refuses it)."""
        knobs = self.knobs
        runtime = knobs.runtime
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
        # hooks (a profiler's) want Triton's launch metadata; a hook set as a plain
        # function has no ``calls``
        if self.tail is None or (self.cluster == 1 and (self.kernel.pre_run_hooks
                or getattr(enter, "calls", True) or getattr(leave, "calls", True))):  # fmt: skip
            return None, (*arguments, *scalars)
        # Triton compiles anew when its options change: so does the key
        key = [self.driver.active.get_current_device(), runtime.debug,
               knobs.compilation.instrumentation_mode]  # fmt: skip
        passed = []
        try:
            for argument in arguments:  # specialization's, tensors inline: the common case
                if type(argument) is torch.Tensor:
                    address = argument.data_ptr()
                    key.append((argument.dtype, address % 16 == 0))
                    passed.append(address if argument.is_cuda else argument)
                else:
                    key.append(specialization(argument))
                    passed.append(argument)
        except TypeError:  # an argument of a type not keyed here
            return None, (*arguments, *scalars)
        return (*key, *keys), [*passed, *scalars]


def _direct(compiled, metadata) -> tuple:
    """How ``BoundKernel`` launches ``compiled`` (a Triton 3.6 ``CompiledKernel``) with
    ``metadata`` (its packed metadata, or a cluster's): ``(launch, function, head,
    descriptors)``, called as ``launch(x, y, z, stream, function, *head, *arguments)``
    with the arguments' tensor descriptors encoded by ``descriptors`` (None: none to
    encode). Without scratch memory, the compiled launcher's own entry (Triton's Python
    wrappers around it allocate scratch and encode the descriptors at every launch);
    with it, through the wrappers."""
    launcher = compiled.run
    tail = (metadata, None, None, None)  # no launch metadata, no hooks
    # a kernel that failed to load has a launcher that raises why (a partial): kept
    if getattr(launcher, "global_scratch_size", True) or launcher.profile_scratch_size:
        return launcher, compiled.function, tail, None
    head = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, *tail)
    launch, descriptors = launcher.launch, None
    names = getattr(getattr(launch, "__code__", None), "co_freevars", ())
    if "tensordesc_indices" in names:  # the wrapper that encodes them, around the entry
        cells = dict(zip(names, (cell.cell_contents for cell in launch.__closure__),
                         strict=True))  # fmt: skip
        launch, indices = cells["launcher"], sorted(cells["tensordesc_indices"])
        descriptors = Descriptors(indices, cells["tensordesc_meta"])
    return launch, compiled.function, head, descriptors


# The Triton versions whose ``CompiledKernel.run`` takes what ``BoundKernel`` passes.
DIRECT_LAUNCH_TRITON = ("3.6.",)


def direct_launches() -> bool:
    """Whether ``BoundKernel`` launches compiled kernels straight: compiled code (not the
    interpreter) of a ``DIRECT_LAUNCH_TRITON``."""
    import triton  # see the module's docstring

    return not interpreted() and triton.__version__.startswith(DIRECT_LAUNCH_TRITON)


def cluster_launches() -> bool:
    """Whether ``BoundKernel`` can launch kernels in thread-block clusters here: straight
    to the compiled kernels (``direct_launches``), or in the interpreter (one program
    after another: a kernel written for clusters keeps its interpreted path)."""
    return interpreted() or direct_launches()


def specialization(argument) -> tuple:
    """What a kernel compiled for ``argument`` may depend on: a tensor's dtype and
    whether it starts on a 16-byte boundary, an integer's value class (1, a multiple
    of 16, its width), a tensor descriptor's everything but its base's address; a
    ``TypeError`` for anything else (Triton specializes on more than is known here)."""
    if isinstance(argument, torch.Tensor):
        return (argument.dtype, argument.data_ptr() % 16 == 0)
    if type(argument) is int:
        return (argument == 1, argument % 16 == 0, -(2**31) <= argument < 2**31,
                argument < 2**63)  # fmt: skip
    if type(argument) is TmaTensor:  # its layout in tuples: held as it is
        base = argument.base
        return (TmaTensor, base.dtype, base.data_ptr() % 16 == 0, argument[1:])
    from triton.tools.tensor_descriptor import TensorDescriptor  # see the docstring

    if type(argument) is TensorDescriptor:
        base = argument.base
        return (TensorDescriptor, base.dtype, base.data_ptr() % 16 == 0, tuple(argument.shape),
                tuple(argument.strides), tuple(argument.block_shape), argument.padding)  # fmt: skip
    raise TypeError(f"no specialization known for a {type(argument).__name__} argument")


@contextlib.contextmanager
def concurrent_programs():
    """Within it, Triton's interpreter runs a launch's programs each in a thread of its
    own, all at once, instead of one after the other: programs that wait for each
    other (a split normalization row's) then finish, as on a GPU. It reaches into the
    interpreter (``triton.runtime.interpreter``, Triton 3.6): where that has changed
    it raises ``RuntimeError`` rather than let such a launch wait forever."""
    import triton.runtime.interpreter as interpreter  # see the module's docstring

    builder = getattr(interpreter, "interpreter_builder", None)
    executor = getattr(interpreter, "GridExecutor", None)
    needed = ("_init_args_hst", "_restore_args_dev", "constexprs", "fn", "grid")
    present = [hasattr(interpreter, name) for name in ("_patch_lang", "_implicit_cvt")]
    present.append(hasattr(getattr(interpreter, "InterpretedFunction", None), "rewrite"))
    if builder is None or executor is None or not all(present):
        raise RuntimeError(
            "this Triton's interpreter cannot run programs concurrently: run a split "
            "normalization on a GPU, or force another strategy"
        )
    with _CONCURRENT_LOCK:
        local = threading.local()
        plain_class, plain_call = type(builder), executor.__call__

        class Concurrent(plain_class):
            grid_idx = property(lambda self: getattr(local, "index", None),
                                lambda self, value: setattr(local, "index", value))  # fmt: skip

        def call(self, *args_dev, **kwargs):
            missing = [name for name in needed if not hasattr(self, name)]
            if missing:
                raise RuntimeError(f"Triton's GridExecutor lacks {missing}")
            spec = inspect.getfullargspec(self.fn)
            kwargs = {k: v for k, v in kwargs.items() if k in spec.args}
            args_hst, kwargs_hst = self._init_args_hst(args_dev, kwargs)
            patched = interpreter._patch_lang(self.fn)
            failures: list[BaseException] = []
            try:
                args = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
                args = {name: value if name in self.constexprs else interpreter._implicit_cvt(value)
                        for name, value in args.items()}  # fmt: skip
                grid = self.grid(args) if callable(self.grid) else self.grid
                grid = (*grid, *(1,) * (3 - len(grid)))
                builder.set_grid_dim(*grid)

                def program(index):
                    try:
                        builder.set_grid_idx(*index)
                        self.fn(**args)
                    except BaseException as error:  # noqa: BLE001 - re-raised below
                        failures.append(error)

                threads = [threading.Thread(target=program, args=(index,), daemon=True)
                           for index in itertools.product(*map(range, grid))]  # fmt: skip
                for thread in threads:
                    thread.start()
                # a program that failed leaves its partners waiting for it: its error
                # is raised at once (they are daemon threads, left waiting)
                deadline = time.monotonic() + CONCURRENT_TIMEOUT_S
                while any(thread.is_alive() for thread in threads) and not failures:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"a program of {self.fn.__name__} did not finish in "
                            f"{CONCURRENT_TIMEOUT_S} s under the interpreter"
                        )
                    time.sleep(0.01)
            finally:
                patched.restore()
            if failures:
                raise failures[0]
            self._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)

        # A device function's call patches triton.language again (``_patch_lang``), which
        # iterates module dicts another thread may be patching: one program failed so
        # ("dictionary changed size during iteration") and its partners waited forever.
        plain_patch = interpreter._patch_lang
        patching = threading.Lock()

        def patch(fn):
            with patching:
                return plain_patch(fn)

        # A device function is rewritten (parsed, transformed, compiled) at its first call:
        # CPython's parser is not safe from several threads at once (a program died of
        # "AST constructor recursion depth mismatch", a check_gpu job's ranks then a
        # collective apart), so one thread rewrites at a time.
        function = interpreter.InterpretedFunction
        plain_rewrite = function.rewrite
        rewriting = threading.Lock()

        def rewrite(self):
            with rewriting:
                return plain_rewrite(self)

        builder.__class__ = Concurrent
        executor.__call__ = call
        interpreter._patch_lang = patch
        function.rewrite = rewrite
        # The waiting programs poll; Python's default 5 ms between thread switches lets
        # each poll hold the interpreter that long while the program it waits for
        # stands still (a split row test took 13 s so, 2.5 s at 0.2 ms).
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(CONCURRENT_SWITCH_INTERVAL_S)
        try:
            yield
        finally:
            sys.setswitchinterval(switch_interval)
            builder.__class__ = plain_class
            executor.__call__ = plain_call
            interpreter._patch_lang = plain_patch
            function.rewrite = plain_rewrite


CONCURRENT_TIMEOUT_S = 300  # a program under concurrent_programs, at most
CONCURRENT_SWITCH_INTERVAL_S = 2e-4  # between its threads (sys.setswitchinterval)
_CONCURRENT_LOCK = threading.Lock()
