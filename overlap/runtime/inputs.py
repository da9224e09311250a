"""Inputs of a multi-device run, checked with the same verdict on every rank.

A rank describes its local inputs (shape, dtype; ``describe_inputs``), the ranks
exchange the descriptions, and every rank checks all of them (``check_local_inputs``):
symbolic extents are bound from the pieces (a split symbolic extent is the sum of the
pieces along its mesh axis) and every piece must have the local shape its layout gives;
once per set of extents, packed pieces must fill whole bytes and a max/min may not
reduce an axis empty everywhere (``check_bound_extents``). A bad input on one rank thus
raises the same ``InputError`` on every rank, before any collective.

The exchange is a host-side all-gather: too slow to pay on every call of a hot loop.
``InputCheck`` (one per executor) exchanges at the first run and then only when a rank's
own description changes (``check_inputs="changes"``, the default): a rank whose inputs
are as at the last agreed run reuses that run's extents without asking anyone. That is
sound only where any change of the extents changes every rank's own pieces: every
symbolic extent must reach every rank through an axis of one of its inputs that is not
split (a split axis hides it: tokens 8 -> 9 over two ranks leave one piece at 4 rows).
Where it does not, "changes" exchanges at every run, as "always" does
(``InputCheck.changes_seen_everywhere``). A rank whose inputs changed first checks what
it can alone (dtype, rank, static extents) and raises at once on a bad input, naming
itself; its exit (fail-fast, ``launch.failfast``) ends the job. Otherwise it exchanges
on the communicator's input-check group (``Communicator.input_check_timeout_s``): when
every rank's inputs changed, every rank gets the same verdict; when its peers' did not,
they are already in the program's collectives, and it raises ``InputChangeError`` when
the timeout expires instead of waiting with them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fusion.binding import Bindings, InputAt, bind_inputs, check_constraints, resolve
from fusion.errors import InputError
from fusion.exprs import ReductionOp
from fusion.ir import Fusion, Symbol, TensorView
from sharding.layout import Layout, layout_of, local_shape
from sharding.pieces import check_packed_pieces

CHECK_MODES = ("changes", "always", "never")


class InputChangeError(InputError):
    """This rank's inputs changed at a run where not every peer came to check theirs
    within the input-check timeout: the peers are in the program's collectives (their
    inputs did not change) or far behind. The job cannot go on: this rank stops it."""


def check_mode(check_inputs: bool | str) -> str:
    """``run``'s ``check_inputs`` as one of ``CHECK_MODES`` (True is ``"always"``,
    False ``"never"``): when the ranks exchange their inputs' shapes (a small host
    all-gather). ``"changes"``: at the first run and whenever this rank's inputs differ
    from its last checked run's (every rank's inputs must change at the same run: a rank
    whose input is wrong raises at once, one whose inputs changed alone raises
    ``InputChangeError`` after the communicator's ``input_check_timeout_s``), or at every
    run where a change of the extents may leave some rank's pieces as they were (a
    symbolic extent only on split axes, or only on some ranks' inputs). ``"always"``: at
    every run, for programs whose shapes may change on some ranks only. ``"never"``: only
    at the first run (then the shapes must stay)."""
    if check_inputs is True:
        return "always"
    if check_inputs is False:
        return "never"
    if check_inputs not in CHECK_MODES:
        raise ValueError(
            f"check_inputs must be one of {CHECK_MODES} (or a bool), got {check_inputs!r}"
        )
    return check_inputs


@dataclass(frozen=True)
class _Agreed:
    """What the ranks agreed on at the last exchange: this rank's description, the
    extents and the run it happened at."""

    description: list
    bindings: Bindings
    run: int
    signature: tuple | None  # this rank's inputs' (shape, dtype, device), told fast


class InputCheck:
    """The extents of a sharded run, from every rank's inputs, with the same verdict on
    every rank; a host exchange only when some rank's inputs change (see the module).

    ``fingerprint`` and ``posting_order`` tell ranks running different programs apart;
    ``run_count`` is this executor's runs so far on this rank (the ranks run in step).
    """

    def __init__(self, fusion: Fusion, communicator, fingerprint: str,
                 posting_order: Callable[[], list[str]], device: torch.device) -> None:  # fmt: skip
        self.fusion = fusion
        self.communicator = communicator
        self.fingerprint = fingerprint
        self.posting_order = posting_order
        self.device = device
        self.run_count = 0
        self._agreed: _Agreed | None = None
        self.changes_seen_everywhere = changes_seen_everywhere(fusion)

    def bindings(self, local_inputs: Sequence[torch.Tensor | None], mode: str) -> Bindings:
        """The extents for this run (a host exchange only where ``mode`` asks for one)."""
        self.run_count += 1
        agreed = self._agreed
        if mode == "never" and agreed is not None:
            return agreed.bindings
        signature = _signature(local_inputs)
        if (mode == "changes" and agreed is not None and self.changes_seen_everywhere
                and signature is not None and signature == agreed.signature):  # fmt: skip
            return agreed.bindings  # as described at the agreed run: the verdict is its
        try:
            described = describe_inputs(local_inputs, len(self.fusion.inputs), self.device)
        except InputError as error:
            described = str(error)
        if mode == "changes" and not self.changes_seen_everywhere:
            mode = "always"
        changed_alone = mode == "changes" and agreed is not None
        if changed_alone:
            if described == agreed.description:
                return agreed.bindings
            if isinstance(described, str):
                raise InputError(f"rank {self.rank}: {described}")
            check_own_inputs(self.fusion, self.rank, described)
        everyone = self._exchange((self.fingerprint, self.run_count, described),
                                  changed_alone, described)  # fmt: skip
        bindings = self._check(everyone)
        self._agreed = _Agreed(described, bindings, self.run_count, signature)
        return bindings

    @property
    def rank(self) -> int:
        return self.communicator.rank

    def _exchange(self, value: tuple, changed_alone: bool, described: list | str) -> list:
        """Every rank's ``value``. A rank whose inputs changed since the last agreed run
        exchanges on the short-timeout group; if its peers' did not change, it raises
        ``InputChangeError``."""
        if not changed_alone:  # every rank exchanges at this run: the usual timeout
            return self.communicator.all_gather_object(value)
        try:
            return self.communicator.input_check_exchange(value)
        except RuntimeError as error:  # gloo's timeout, or a peer gone
            raise InputChangeError(self._change_message(described, error)) from error

    def _change_message(self, described: list, error: RuntimeError) -> str:
        agreed = self._agreed
        changes = [
            f"input {position}: {_said(before)} -> {_said(now)}"
            for position, (before, now) in enumerate(
                zip(agreed.description, described, strict=True)
            )
            if before != now
        ]
        timeout = self.communicator.input_check_timeout_s
        return (
            f"rank {self.rank}: its inputs changed at run {self.run_count} of this fusion "
            f"({'; '.join(changes)}; as agreed at run {agreed.run}), "
            f"and not every rank came to check its inputs within {timeout:g} s ({error}). "
            "The other ranks' inputs did not change, so they went on into the program's "
            "collectives, which this rank will not post with these inputs: this job cannot "
            "go on. Every rank's inputs must change at the same run; if shapes change on "
            "some ranks only, run with check_inputs='always' on every rank; if ranks may be "
            "further apart, raise Communicator(input_check_timeout_s=...) or "
            "OVERLAP_INPUT_CHECK_TIMEOUT_S"
        )

    def _check(self, everyone: list) -> Bindings:
        """Every rank's verdict on every rank's description: the same on every rank."""
        if any(fingerprint != self.fingerprint for fingerprint, *_ in everyone):
            # the ranks run different programs (rank 0 one executor, rank 1 another)
            self.communicator.agree(None, "run", self.posting_order())
        runs = [run for _, run, _ in everyone]
        if len(set(runs)) > 1:
            raise InputError(
                f"the ranks are at different runs of this fusion ({_by_rank(runs)}): a rank "
                "ran it without its peers (check_inputs='never' with inputs that changed, or "
                "a run skipped on some ranks). Every rank must run it the same times"
            )
        for rank, (_, _, description) in enumerate(everyone):
            if isinstance(description, str):
                raise InputError(f"rank {rank}: {description}")
        return check_local_inputs(self.fusion, [description for _, _, description in everyone])


def _signature(local_inputs) -> tuple | None:
    """Each input's (shape, dtype, device) (None for None), or None for what is not a
    list or tuple of tensors and Nones: equal signatures describe alike."""
    if not isinstance(local_inputs, (list, tuple)):
        return None
    signature = []
    for value in local_inputs:
        if value is None:
            signature.append(None)
        elif isinstance(value, torch.Tensor):
            signature.append((value.shape, value.dtype, value.device))
        else:
            return None
    return tuple(signature)


def _said(entry: tuple | None) -> str:
    if entry is None:
        return "None"
    shape, dtype = entry
    return f"{list(shape)} {dtype.removeprefix('torch.')}"


def _by_rank(values: list) -> str:
    return ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))


class LocalBinding:
    """An unplaced fusion's inputs checked and bound (``bind_inputs``, ``check_devices``),
    again only when an input's type, dtype, shape or device changed: the verdict reads
    nothing else. Binding took 15-25 us of host time a run, more than a small
    normalization's kernels (RMSNorm backward at 1024x4096: 11 us on an H200)."""

    def __init__(self, fusion: Fusion, device: torch.device) -> None:
        self.fusion, self.device = fusion, device
        self.signature: tuple | None = None
        self.bindings: Bindings | None = None  # of the last inputs that passed

    def __call__(self, local_inputs: Sequence[torch.Tensor]) -> Bindings:
        if not isinstance(local_inputs, (list, tuple)):  # bind_inputs says why
            return bind_inputs(self.fusion, local_inputs)
        signature = tuple((t.dtype, t.shape, t.device) if isinstance(t, torch.Tensor)
                          else type(t) for t in local_inputs)  # fmt: skip
        if signature != self.signature or self.bindings is None:
            bindings = bind_inputs(self.fusion, local_inputs)
            check_devices(local_inputs, self.device)
            self.bindings, self.signature = bindings, signature  # only once both passed
        return self.bindings


def describe_inputs(
    local_inputs: Sequence[torch.Tensor | None], count: int, device: torch.device
) -> list[tuple[list[int], str] | None]:
    if not isinstance(local_inputs, (list, tuple)):
        raise InputError(f"local inputs must be a list, got {type(local_inputs).__name__}")
    if len(local_inputs) != count:
        raise InputError(f"the fusion takes {count} inputs, got {len(local_inputs)}")
    described = []
    for position, value in enumerate(local_inputs):
        if value is None:
            described.append(None)
        elif isinstance(value, torch.Tensor):
            _check_device(position, value, device)
            described.append((list(value.shape), str(value.dtype)))
        else:
            raise InputError(
                f"input {position}: expected a torch.Tensor or None, got {type(value).__name__}"
            )
    return described


def _check_device(position: int, value: torch.Tensor, device: torch.device) -> None:
    if value.device.type != device.type or (
        device.index is not None and value.device.index != device.index
    ):
        raise InputError(
            f"input {position}: on {value.device}, but this rank runs on {device}"
            + (" (meta tensors hold no values to run on)" if value.is_meta else "")
        )


def check_devices(local_inputs: Sequence[torch.Tensor], device: torch.device) -> None:
    """Every input is on ``device`` (a tensor on another device, or on ``meta``, is refused)."""
    for position, value in enumerate(local_inputs):
        _check_device(position, value, device)


def _value_shape(tensor: TensorView, rank: int, entry, where: InputAt) -> list[int]:
    """``rank``'s described piece of input ``tensor`` (present, its dtype and rank
    checked), in values (a packed piece's innermost extent unpacked)."""
    if entry is None:
        raise InputError(f"rank {rank}: {where} is on this rank but got None")
    shape, dtype = entry
    expected_dtype = str(tensor.dtype.torch_dtype)
    if dtype != expected_dtype:
        raise InputError(f"rank {rank}: {where}: expected dtype {expected_dtype}, got {dtype}")
    if len(shape) != tensor.ndim:
        raise InputError(f"rank {rank}: {where}: expected rank {tensor.ndim}, got shape {shape}")
    if tensor.dtype.is_packed:
        shape = shape[:-1] + [shape[-1] * tensor.dtype.values_per_storage_element]
    return list(shape)


def check_own_inputs(fusion: Fusion, rank: int, described: list) -> None:
    """What ``rank`` can check of its own described inputs without its peers: present
    where placed, dtype, rank and every static extent of its piece (the same words as
    ``check_local_inputs``). Raises ``InputError`` naming the rank."""
    for position, tensor in enumerate(fusion.inputs):
        if rank not in tensor.mesh.ranks:
            continue
        shape = _value_shape(tensor, rank, described[position], InputAt(position, tensor))
        layout = layout_of(tensor)
        whole = [0 if isinstance(e, Symbol) else e for e in tensor.shape]
        expected = local_shape(layout, rank, whole)
        static = [not isinstance(e, Symbol) for e in tensor.shape]
        if all(static) and list(shape) != expected:
            raise InputError(
                f"rank {rank}: input {position} ({tensor}) placed {layout}: expected the "
                f"local shape {expected} (of the whole {whole}), got {list(shape)}"
            )
        for dim, known in enumerate(static):
            if known and shape[dim] != expected[dim]:
                raise InputError(
                    f"rank {rank}: input {position} ({tensor}) placed {layout}: expected "
                    f"{expected[dim]} along axis {dim} of its piece, got shape {list(shape)}"
                )


def changes_seen_everywhere(fusion: Fusion) -> bool:
    """Whether every rank sees every symbolic extent of the inputs on an axis of its own
    inputs that is not split, so that any change of the extents changes every rank's
    own pieces (see the module)."""
    ranks = {r for tensor in fusion.inputs for r in tensor.mesh.ranks}
    seen: dict[int, set[Symbol]] = {rank: set() for rank in ranks}
    symbols: set[Symbol] = set()
    for tensor in fusion.inputs:
        layout = layout_of(tensor)
        for dim, extent in enumerate(tensor.shape):
            if isinstance(extent, Symbol):
                symbols.add(extent)
                if layout.mesh_axis_of(dim) is None:
                    for rank in tensor.mesh.ranks:
                        seen[rank].add(extent)
    return all(symbols <= seen[rank] for rank in ranks)


def check_local_inputs(fusion: Fusion, everyone: list[list]) -> Bindings:
    """Check every rank's described inputs (shape, dtype per input) and bind the symbols.

    A symbolic extent split over a mesh axis is the sum of the pieces along that axis.
    Raises ``InputError`` naming the rank, the input and the mismatch.
    """
    bindings: Bindings = {}
    pieces: list[dict[int, list[int]]] = []  # by input, each rank's shape in values
    for position, tensor in enumerate(fusion.inputs):
        layout = layout_of(tensor)
        where = InputAt(position, tensor)
        shapes = {
            rank: _value_shape(tensor, rank, everyone[rank][position], where)
            for rank in tensor.mesh.ranks
        }
        pieces.append(shapes)
        _bind_symbols(tensor, layout, shapes, bindings, where)
    check_constraints(fusion, bindings)
    for position, tensor in enumerate(fusion.inputs):
        layout = layout_of(tensor)
        whole = [resolve(e, bindings) for e in tensor.shape]
        for rank, shape in pieces[position].items():
            expected = local_shape(layout, rank, whole)
            if shape != expected:
                raise InputError(
                    f"rank {rank}: input {position} ({tensor}) placed {layout}: expected the "
                    f"local shape {expected} (of the whole {whole}), got {shape}"
                )
    return bindings


def check_bound_extents(fusion: Fusion, bindings: Bindings) -> None:
    """What only the bound extents tell, checked once per set of extents: packed pieces
    fill whole bytes, and no max/min reduces an axis empty everywhere."""
    check_packed_pieces(fusion, bindings, InputError)
    check_extremes_have_values(fusion, bindings)


def check_extremes_have_values(fusion: Fusion, bindings: Bindings) -> None:
    """A max or min over an axis that is empty on every rank has no value (the reference
    refuses it too); a piece empty on some ranks only is fine (the identity there)."""
    for expr in fusion.exprs:
        if not isinstance(expr, ReductionOp) or expr.op_name not in ("max", "min"):
            continue
        source = expr.inputs[0]
        empty = [d for d in expr.dims if resolve(source.shape[d], bindings) == 0]
        if empty:
            raise InputError(
                f"{expr.op_name} over axis {empty[0]} of {source}, which is empty (extent 0 "
                f"with these inputs): a {expr.op_name} of no values has none"
            )


def _bind_symbols(
    tensor: TensorView,
    layout: Layout,
    shapes: dict[int, list[int]],
    bindings: Bindings,
    where: InputAt,
) -> None:
    for dim, extent in enumerate(tensor.shape):
        if not isinstance(extent, Symbol):
            continue
        mesh_axis = layout.mesh_axis_of(dim)
        first = tensor.mesh.ranks[0]
        if mesh_axis is None:
            value = shapes[first][dim]
        else:
            value = sum(shapes[r][dim] for r in tensor.mesh.team(first, mesh_axis))
        if extent in bindings and bindings[extent] != value:
            raise InputError(
                f"{where}: axis {dim} is {value} in all, but symbol {extent} is already "
                f"{bindings[extent]}"
            )
        bindings[extent] = value


def digest(value: torch.Tensor | None) -> str | None:
    """A whole tensor's fingerprint: its shape, dtype and a hash of its bytes (exact)."""
    if value is None:
        return None
    flat = value.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
    return (
        f"{list(value.shape)} {value.dtype} {hashlib.blake2b(flat.numpy().tobytes()).hexdigest()}"
    )


def check_same_on_every_rank(
    names: Sequence[str], values: Sequence[torch.Tensor | None], exchange: Callable, step: str
) -> None:
    """Every rank was given the same whole tensors ``values`` (``exchange``: the
    communicator's input-check all-gather; one exchange of their fingerprints), else
    every rank raises the same ``InputError`` naming the first tensor and rank that
    differ. Each rank cuts its own piece from the whole tensors it is given: from tensors
    that differ (unseeded random inputs or weights, say) the pieces would assemble into a
    whole no rank was given."""
    everyone = exchange([digest(value) for value in values])
    for rank, other in enumerate(everyone):
        if len(other) != len(everyone[0]):
            raise InputError(f"{step}: rank 0 was given {len(everyone[0])} whole tensors, "
                             f"rank {rank} {len(other)}")  # fmt: skip
        for name, mine, theirs in zip(names, everyone[0], other, strict=False):
            if mine != theirs:
                raise InputError(
                    f"{step}: the ranks were given different whole tensors: {name} differs "
                    f"between rank 0 and rank {rank}. Each rank cuts its piece from the whole "
                    "tensors it is given, so every rank must be given the same ones: make "
                    "them from one seeded generator (torch.Generator().manual_seed(...), or "
                    "torch.manual_seed before building a module), or give each rank its "
                    "own pieces"
                )
