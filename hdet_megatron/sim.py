"""Noisy-quadratic-model (NQM) simulator of HDET: study the controller at scale in seconds.

The problem (a *tracking* NQM): ``dim`` independent coordinates with curvatures ``h_i``
log-spaced in ``[h_min, h_max]``. The loss of a replica is ``0.5 * sum_i h_i e_i^2`` where
``e = theta - theta*`` is its error. Every step

* each replica draws a noisy gradient ``h * e + xi`` with ``xi_i ~ N(0, noise * h_i)`` (the NQM's
  gradient covariance proportional to the curvature), independent across replicas;
* gradients are averaged over all replicas (``grad_sync="global"``, the paper's DDP) or inside
  each arm (``"arm"``), and replica ``j`` of arm ``r`` steps ``e <- e - lr_r * g``;
* the optimum moves: ``theta*`` takes a random-walk step ``N(0, drift)`` per coordinate, the
  same for all replicas (the data distribution drifts).

Every ``config.period`` steps the replicas converge (their errors are averaged over the
replicas of the arms whose loss is finite) and the :class:`~hdet_megatron.controller.AutoController`
updates the LR scale from the arms' mean window losses.

Why the drift: it gives the problem a *time-invariant* interior optimum LR, so "did the
controller find the best LR" has a clean answer. Too low an LR lags behind the moving optimum
(loss ~ drift / lr), too high amplifies gradient noise (loss ~ lr * noise) and diverges above
``2 / h_max``. In steady state, plain data-parallel SGD with ``N`` replicas at constant LR
``eta`` has (exactly, per coordinate, a scalar linear recursion for the second moment)::

    E[loss](eta) = sum_i 0.5 * (eta^2 * noise * h_i / N + drift) / (eta * (2 - eta * h_i))

:func:`best_lr` minimises this analytically-known function ("by construction"); a grid sweep
of plain training in this simulator (:func:`sweep_lr`) agrees with it (tested). Note that the
averaged model of ``grad_sync="arm"`` plain training follows the same recursion (the gradient
is linear in the parameters), so the formula holds for both sync modes.

Things to know when reading results:

* ``grad_sync="global"``: the gradient is linear in the parameters, so the *averaged* model
  follows plain SGD at the arms' mean LR exactly; the spread itself costs nothing here, and only
  the controller's choice of scale changes the converged model.
* ``grad_sync="arm"``: each arm's window loss carries its own (one arm's batch) gradient noise,
  so the controller settles near ``best_lr(problem, replicas_per_arm)``, below the optimum of
  the full data-parallel batch (see ``tests/test_sim.py``).
* A rollback (``config.rollback`` when every arm diverged) uses up its window of the budget.

Randomness: one local ``numpy.random.Generator`` per run, seeded from ``seed``; no global RNG.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hdet_megatron.config import HDETConfig
from hdet_megatron.controller import AllArmsNonFinite, AutoController, ControllerUpdate
from hdet_megatron.spread import arm_spread

__all__ = [
    "NQMProblem",
    "SimResult",
    "simulate",
    "steady_state_loss",
    "best_lr",
    "sweep_lr",
    "BudgetNQM",
    "BudgetResult",
    "simulate_budget",
    "budget_expected_loss",
    "budget_best_peak_lr",
]


@dataclass(frozen=True)
class NQMProblem:
    """The tracking noisy quadratic (see the module docstring). Defaults put the optimum LR of
    8 replicas near 0.26, well inside the stable range ``lr < 2 / h_max = 2``, so both 4x too
    low and 4x too high (times the largest arm multiplier) are stable but clearly worse."""

    dim: int = 16
    h_min: float = 0.1
    h_max: float = 1.0
    noise: float = 1.0
    """Per-replica gradient-noise variance per unit curvature."""
    drift: float = 4e-3
    """Per-step random-walk variance of every coordinate of the optimum."""
    init_scale: float = 1.0
    """Std of the initial error of every coordinate (identical for all replicas)."""

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"NQMProblem.dim={self.dim!r} must be an integer >= 1")
        if not 0 < self.h_min <= self.h_max:
            raise ValueError(f"NQMProblem curvatures need 0 < h_min <= h_max, got {self.h_min}, {self.h_max}")
        for name in ("noise", "drift", "init_scale"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"NQMProblem.{name}={value!r} must be a finite number >= 0")
        if self.noise == 0 and self.drift == 0:
            raise ValueError("NQMProblem needs noise > 0 or drift > 0 for an interior optimum LR")

    def curvatures(self) -> list[float]:
        """``h_i``, log-spaced in ``[h_min, h_max]``."""
        if self.dim == 1:
            return [self.h_max]
        ratio = math.log(self.h_max / self.h_min)
        return [self.h_min * math.exp(ratio * i / (self.dim - 1)) for i in range(self.dim)]


def steady_state_loss(problem: NQMProblem, lr: float, replicas: int = 1) -> float:
    """Expected steady-state loss of plain data-parallel SGD (``replicas`` replicas, gradients
    averaged over all of them) at constant ``lr``; ``inf`` where it is unstable."""
    if not lr > 0:
        return math.inf
    total = 0.0
    for h in problem.curvatures():
        if lr * h >= 2.0:
            return math.inf
        total += 0.5 * (lr * lr * problem.noise * h / replicas + problem.drift) / (lr * (2.0 - lr * h))
    return total


def best_lr(problem: NQMProblem | None = None, replicas: int = 8) -> float:
    """The LR minimising :func:`steady_state_loss` (known by construction; golden-section
    search on ``log lr`` over the stable range, the function being unimodal there)."""
    problem = problem or NQMProblem()
    lo, hi = math.log(1e-8), math.log(2.0 / problem.h_max) - 1e-12
    inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo, hi
    x1, x2 = b - inv_phi * (b - a), a + inv_phi * (b - a)
    f1, f2 = (steady_state_loss(problem, math.exp(x), replicas) for x in (x1, x2))
    for _ in range(200):
        if f1 <= f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - inv_phi * (b - a)
            f1 = steady_state_loss(problem, math.exp(x1), replicas)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + inv_phi * (b - a)
            f2 = steady_state_loss(problem, math.exp(x2), replicas)
    return math.exp((a + b) / 2.0)


@dataclass
class SimResult:
    """Per-window trajectories of one simulated run (window k ends at step ``(k+1)*period``)."""

    steps: list[int]
    """Step at which each window ended."""
    scales: list[float]
    """The LR axis' scale c after each window's controller update."""
    losses: list[float]
    """Mean training loss over the window (all steps, all healthy replicas)."""
    converged_losses: list[float]
    """Loss of the converged (averaged) model after each window."""
    base_lr: float
    best_lr: float
    """Analytic optimum LR of plain training with the same replica count (:func:`best_lr`)."""
    rollbacks: int = 0
    updates: list[ControllerUpdate] = field(default_factory=list)
    """Every controller update (only if ``simulate(..., keep_updates=True)``)."""

    @property
    def final_scale(self) -> float:
        return self.scales[-1]

    @property
    def final_lr(self) -> float:
        """``base_lr * c`` at the end of the run."""
        return self.base_lr * self.scales[-1]

    @property
    def final_loss(self) -> float:
        """Mean converged-model loss over the last 10% of the windows (at least one)."""
        tail = self.converged_losses[-max(1, len(self.converged_losses) // 10) :]
        return float(np.mean(tail))


def _check_run(config: HDETConfig, arms: int, replicas_per_arm: int, steps: int, **positive: float) -> None:
    """The arguments both simulators share: one ``lr`` axis, integer counts >= 1, and the named
    LR argument a finite number > 0."""
    names = [a.name for a in config.resolved_axes]
    if names != ["lr"]:
        raise ValueError(f"the simulator models exactly one axis, 'lr'; config has {names}")
    for name, value in (("arms", arms), ("replicas_per_arm", replicas_per_arm), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    for name, number in positive.items():
        if not math.isfinite(number) or number <= 0:
            raise ValueError(f"{name}={number!r} must be a finite number > 0")


def simulate(
    config: HDETConfig,
    arms: int,
    base_lr: float,
    steps: int,
    replicas_per_arm: int = 1,
    dim: int = 16,
    seed: int = 0,
    problem: NQMProblem | None = None,
    keep_updates: bool = False,
) -> SimResult:
    """Run HDET on the tracking NQM for ``steps`` steps (rounded down to whole windows).

    ``arms`` arms of ``replicas_per_arm`` replicas each; arm r uses
    ``lr = base_lr * c * rho`` with ``rho`` from :func:`hdet_megatron.spread.arm_spread` and c the
    controller's scale of the ``lr`` axis (the only axis this simulator models). ``config``
    supplies the period, spread, sync mode and controller settings (``config.arms`` is ignored
    in favour of ``arms``). ``problem`` defaults to ``NQMProblem(dim=dim)``; if given, ``dim``
    must equal ``problem.dim``.
    """
    if problem is None:
        problem = NQMProblem(dim=dim)
    elif dim != problem.dim:
        raise ValueError(f"dim={dim} disagrees with problem.dim={problem.dim}; pass one of them")
    config = config.resolve(False, arms).config  # the training-loss simulator has no probe
    _check_run(config, arms, replicas_per_arm, steps, base_lr=base_lr)

    rng = np.random.default_rng(seed)
    period = config.period
    windows = steps // period
    if windows < 1:
        raise ValueError(f"steps={steps} is shorter than one window (period={period})")
    replicas = arms * replicas_per_arm
    h = np.asarray(problem.curvatures())
    drift_std = math.sqrt(problem.drift)
    controller = AutoController(config, arms)
    # All replicas of one arm start equal, apply the same (arm- or globally-averaged) gradient
    # with the same LR, so they stay equal: the state is one error vector per arm, and the
    # replicas only enter through the noise of the averaged gradient (the mean of m independent
    # N(0, noise*h) draws is N(0, noise*h/m), drawn directly).
    sync_replicas = replicas if config.grad_sync == "global" else replicas_per_arm
    grad_noise_std = np.sqrt(problem.noise * h / sync_replicas)

    error = np.broadcast_to(rng.normal(0.0, problem.init_scale, size=problem.dim), (arms, problem.dim)).copy()
    last_good = error[0].copy()
    result = SimResult([], [], [], [], base_lr, best_lr(problem, replicas))
    window = 0
    while window < windows:
        rho = np.asarray(arm_spread(config, arms, controller.window)["lr"])
        lr = (base_lr * controller.scale("lr") * rho)[:, None]
        # One draw per window (fewer, larger numpy calls); the stream is fixed by the seed.
        if config.grad_sync == "global":
            noise = grad_noise_std * rng.standard_normal((period, 1, problem.dim))
        else:
            noise = grad_noise_std * rng.standard_normal((period, arms, problem.dim))
        drift = drift_std * rng.standard_normal((period, problem.dim))
        loss_sum = np.zeros(arms)
        with np.errstate(over="ignore", invalid="ignore"):
            for t in range(period):
                loss_sum += (error * error) @ h
                if config.grad_sync == "global":
                    grad = h * error.mean(axis=0) + noise[t]
                else:
                    grad = h * error + noise[t]
                error = error - lr * grad + drift[t]
        arm_losses = 0.5 * loss_sum / period
        step = (window + 1) * period
        try:
            update = controller.update(
                arm_losses.tolist(), {"lr": rho.tolist()}, step, base_values={"lr": base_lr}
            )
        except AllArmsNonFinite:
            if not config.rollback:
                raise
            # Roll back to the last converged state and retry the window with half the scale.
            error = np.broadcast_to(last_good, error.shape).copy()
            controller.cut_scale(0.5)
            result.rollbacks += 1
            window += 1
            continue
        healthy = np.isfinite(arm_losses)
        # Converge: the healthy arms' mean overwrites every arm (arms have equal replica counts).
        mean_error = error[healthy].mean(axis=0)
        error = np.broadcast_to(mean_error, error.shape).copy()
        last_good = mean_error
        result.steps.append(step)
        result.scales.append(controller.scale("lr"))
        result.losses.append(float(arm_losses[healthy].mean()))
        result.converged_losses.append(float(0.5 * (h * mean_error * mean_error).sum()))
        if keep_updates:
            result.updates.append(update)
        window += 1
    return result


def sweep_lr(
    lrs: Sequence[float],
    replicas: int = 8,
    steps: int = 20000,
    burn_in: int = 5000,
    seed: int = 0,
    problem: NQMProblem | None = None,
) -> list[float]:
    """Mean loss of plain data-parallel SGD (``replicas`` replicas, gradients averaged over
    all of them, constant LR) at each LR, averaged over steps ``burn_in..steps`` of this
    simulator: the empirical counterpart of :func:`steady_state_loss` (``inf``/``nan`` where it
    diverges). All LRs run side by side on the same random numbers (common random numbers),
    so the comparison between LRs is much less noisy than the losses themselves."""
    problem = problem or NQMProblem()
    if not 0 <= burn_in < steps:
        raise ValueError(f"need 0 <= burn_in < steps, got burn_in={burn_in}, steps={steps}")
    rng = np.random.default_rng(seed)
    h = np.asarray(problem.curvatures())
    lr = np.asarray(lrs, dtype=float)[:, None]
    noise_std = np.sqrt(problem.noise * h)
    drift_std = math.sqrt(problem.drift)
    error = np.broadcast_to(
        rng.normal(0.0, problem.init_scale, size=problem.dim), (len(lr), problem.dim)
    ).copy()
    # The gradient noise averaged over `replicas` replicas, and the drift, for every step.
    noise = (noise_std / math.sqrt(replicas)) * rng.standard_normal((steps, problem.dim))
    drift = drift_std * rng.standard_normal((steps, problem.dim))
    total = np.zeros(len(lr))
    with np.errstate(over="ignore", invalid="ignore"):
        for t in range(steps):
            if t >= burn_in:
                total += 0.5 * ((error * error) @ h)
            error = error - lr * (h * error + noise[t]) + drift[t]
    losses: list[float] = (total / (steps - burn_in)).tolist()
    return losses


# --- the budget NQM: a fixed training budget under a decaying LR schedule ---------------------
#
# The tracking NQM above has a time-invariant optimum LR, so a window-local comparison is
# unbiased there. Real pretraining is a fixed budget under a decaying schedule, where the best
# *peak* LR is set by what survives to the end of the run: progress in slow (low-curvature)
# directions persists, while the noise floor of fast directions is forgotten once the LR decays.
# A window-local comparison sees the noise floor and prefers small steps: the short-horizon bias
# (Wu, Ren, Liao and Grosse, ICLR 2018). This model reproduces it.


@dataclass(frozen=True)
class BudgetNQM:
    """A noisy quadratic trained from a fixed start for a fixed number of steps under a
    warm-up + cosine schedule (the shape of ``examples/pretrain_gpt``'s benchmark runs).

    Loss ``0.5 * sum_i h_i e_i^2``; gradient ``h * e + xi`` with ``xi_i ~ N(0, noise * h_i)`` per
    replica; curvatures log-spaced in ``[h_min, h_max]``; initial error ``N(0, init_scale^2)``
    per coordinate. The defaults put the best peak LR of 8 replicas near 0.25 (stable up to 2).
    """

    dim: int = 32
    h_min: float = 1e-3
    h_max: float = 1.0
    noise: float = 1.0
    """Per-replica gradient-noise variance per unit curvature."""
    init_scale: float = 1.0
    """Std of the initial error of every coordinate (identical for all replicas)."""
    warmup_fraction: float = 0.03
    """Linear warm-up from 0 over this fraction of the steps."""
    final_fraction: float = 0.1
    """The cosine decays to this fraction of the peak LR at the last step."""
    loss_noise: float = 0.5
    """Std of one replica's measured training loss at one step around its expected loss (which
    batch it saw): the data noise of ``signal="train"``. ``probe`` and ``line`` evaluate on data
    common to all arms and see none of it."""
    probe_noise: float = 0.0
    """Std of one replica's loss at one line point around its expected value (each replica
    evaluates the line on its own small batch); 0: exact points. The noise-aware step reads the
    replicas' spread."""

    def __post_init__(self) -> None:
        NQMProblem(
            dim=self.dim,
            h_min=self.h_min,
            h_max=self.h_max,
            noise=self.noise,
            drift=0.0,
            init_scale=self.init_scale,
        )  # same checks as the tracking model
        if not 0 <= self.warmup_fraction < 1 or not 0 <= self.final_fraction <= 1:
            raise ValueError(
                f"BudgetNQM needs 0 <= warmup_fraction < 1 and 0 <= final_fraction <= 1, got "
                f"{self.warmup_fraction}, {self.final_fraction}"
            )
        if not math.isfinite(self.loss_noise) or self.loss_noise < 0:
            raise ValueError(f"BudgetNQM.loss_noise={self.loss_noise!r} must be >= 0")
        if not math.isfinite(self.probe_noise) or self.probe_noise < 0:
            raise ValueError(f"BudgetNQM.probe_noise={self.probe_noise!r} must be >= 0")

    def curvatures(self) -> np.ndarray:
        return np.exp(np.linspace(math.log(self.h_min), math.log(self.h_max), self.dim))

    def schedule(self, steps: int, peak_lr: float) -> np.ndarray:
        """The base LR at every step: linear warm-up, then cosine to ``final_fraction * peak``."""
        t = np.arange(steps, dtype=float)
        warm = max(1, int(round(self.warmup_fraction * steps)))
        progress = np.clip((t - warm) / max(1, steps - warm), 0.0, 1.0)
        f = self.final_fraction
        lr = peak_lr * (f + (1 - f) * 0.5 * (1 + np.cos(math.pi * progress)))
        return np.where(t < warm, peak_lr * (t + 1) / warm, lr)


def _final_losses(
    problem: BudgetNQM, lrs: Sequence[float] | np.ndarray, scales: np.ndarray, replicas: int
) -> np.ndarray:
    """Exact expected final loss of plain data-parallel SGD with the per-step LRs ``lrs * scale``
    for every ``scale`` in ``scales`` at once (the second moment of each coordinate obeys a
    scalar linear recursion); ``inf`` where it blows up."""
    h = problem.curvatures()
    m = np.full((len(scales), problem.dim), problem.init_scale**2)
    with np.errstate(over="ignore", invalid="ignore"):
        for unit in lrs:
            lr = (scales * unit)[:, None]
            m = (1.0 - lr * h) ** 2 * m + lr * lr * problem.noise * h / replicas
    loss = 0.5 * (m * h).sum(axis=1)
    return np.where(np.isfinite(loss), loss, np.inf)


def budget_expected_loss(problem: BudgetNQM, lrs: Sequence[float], replicas: int) -> float:
    """Exact expected final loss of plain data-parallel SGD (``replicas`` replicas) run with the
    per-step LRs ``lrs`` (``inf`` if it blows up)."""
    return float(_final_losses(problem, lrs, np.ones(1), replicas)[0])


def _budget_losses(problem: BudgetNQM, steps: int, peaks: np.ndarray, replicas: int) -> np.ndarray:
    """:func:`budget_expected_loss` of the base schedule at every peak LR in ``peaks`` at once."""
    return _final_losses(problem, problem.schedule(steps, 1.0), peaks, replicas)


@functools.lru_cache(maxsize=64)
def budget_best_peak_lr(problem: BudgetNQM, steps: int, replicas: int) -> tuple[float, float]:
    """``(peak LR, expected final loss)`` of the best plain run on this schedule shape: what a
    perfect LR sweep finds (a log grid of 1/32 octave over the stable range, then a grid 32x
    finer around its best point; all candidates run side by side)."""
    hi = math.log2(2.0 / problem.h_max)
    coarse = 2.0 ** np.arange(-14.0, hi, 1 / 32)
    losses = _budget_losses(problem, steps, coarse, replicas)
    k = int(np.argmin(losses))
    fine = coarse[k] * 2.0 ** np.linspace(-1 / 32, 1 / 32, 65)
    fine_losses = _budget_losses(problem, steps, fine, replicas)
    j = int(np.argmin(fine_losses))
    return float(fine[j]), float(fine_losses[j])


@dataclass
class BudgetResult:
    """One :func:`simulate_budget` run."""

    start_scale: float
    """Peak LR of the run's base schedule / the best peak LR."""
    scales: list[float]
    """The controller's scale c after each window."""
    lrs: list[float]
    """The LR of the averaged model (base schedule x c) at every step."""
    expected_loss: float
    """Exact expected final loss of plain training with ``lrs`` (what the averaged model
    follows in ``grad_sync="global"``): the figure of merit, free of the run's own noise."""
    best_loss: float
    """Expected final loss at the best peak LR (a perfect sweep of the same schedule shape)."""
    final_loss: float
    """This run's realised final loss of the averaged model."""
    updates: list[ControllerUpdate] = field(default_factory=list)
    """The controller's update at every window (brake, confidence, ...)."""

    @property
    def gap(self) -> float:
        """``expected_loss / best_loss - 1``: how far from a perfect sweep (negative = better)."""
        return self.expected_loss / self.best_loss - 1.0

    @property
    def effective_scales(self) -> list[float]:
        """Per window: ``start_scale * c``, the base LR relative to the best peak LR."""
        return [self.start_scale * c for c in self.scales]


def simulate_budget(
    config: HDETConfig,
    arms: int,
    start_scale: float,
    steps: int,
    replicas_per_arm: int = 1,
    seed: int = 0,
    problem: BudgetNQM | None = None,
) -> BudgetResult:
    """HDET on :class:`BudgetNQM` from a peak LR ``start_scale`` times the best one.

    ``grad_sync="global"`` only (the arms share the all-replica gradient, so they lie on one
    update line per window). The controller's signal is ``config.signal``:

    * ``train``: each arm's mean measured training loss over the window (its iterates'
      expected loss plus the data noise ``problem.loss_noise / sqrt(steps * replicas_per_arm)``);
    * ``probe``: each arm's exact loss at the window's end (common data, no data noise);
    * ``line``: the exact losses along the update line at the arms' multipliers, horizon-
      corrected by :func:`hdet_megatron.line_signal.fit_line` with
      ``kappa = base(end) / base(now)``;
    * ``average``: the exact losses along the line through the arms' window-averaged iterates
      (uncorrected).
    """
    from hdet_megatron.line_signal import fit_line, line_points, persistence

    problem = problem or BudgetNQM()
    if config.grad_sync != "global":
        raise ValueError("simulate_budget models grad_sync='global' only")
    config = config.resolve(True, arms).config  # the simulator can evaluate any point
    _check_run(config, arms, replicas_per_arm, steps, start_scale=start_scale)
    period = config.period
    if steps < period:
        raise ValueError(f"steps={steps} is shorter than one window (period={period})")
    replicas = arms * replicas_per_arm
    best_peak, best_loss = budget_best_peak_lr(problem, steps, replicas)
    base = problem.schedule(steps, best_peak * start_scale)
    h = problem.curvatures()
    rng = np.random.default_rng(seed)
    controller = AutoController(config, arms)
    updates: list[ControllerUpdate] = []
    side_rng = np.random.default_rng([seed, 1])
    noise_std = np.sqrt(problem.noise * h / replicas)
    error = rng.normal(0.0, problem.init_scale, size=problem.dim)  # the averaged model
    lrs: list[float] = []
    scales: list[float] = []
    t = 0
    while t < steps:
        length = min(period, steps - t)
        rho = np.asarray(arm_spread(config, arms, controller.window)["lr"])
        c = controller.scale("lr")
        start = error.copy()
        update = np.zeros(problem.dim)  # D: the window's update at multiplier 1
        update_sum = np.zeros(problem.dim)  # sum of D_t over the window ("average")
        train = np.zeros(arms)
        with np.errstate(over="ignore", invalid="ignore"):
            for _ in range(length):
                arm_err = start[None, :] - rho[:, None] * update[None, :]
                train += 0.5 * (arm_err * arm_err) @ h
                lr = base[t] * c
                # Every arm applies the all-replica gradient (evaluated at the arms' mean, which is
                # exact for a quadratic) with its own multiplier: the arms stay on one line.
                update += lr * (h * (start - update) + noise_std * rng.standard_normal(problem.dim))
                update_sum += update
                lrs.append(lr)
                t += 1
        error = start - update
        end = start[None, :] - rho[:, None] * update[None, :]
        end_losses = 0.5 * (end * end) @ h
        data = problem.loss_noise / math.sqrt(length * replicas_per_arm)
        # The training signal's noise from the run's stream; the brake's copy of the training
        # losses and the probes' noise from a stream of their own, so that the line signals see
        # the same run as without them.
        train_rng = rng if config.signal == "train" else side_rng
        train_losses = train / length + data * train_rng.standard_normal(arms)
        line = None
        if config.signal == "train":
            losses = train_losses
        elif config.signal == "probe":
            losses = end_losses
        else:
            points = line_points(rho.tolist())
            if config.signal == "average":  # the line through the window-averaged iterates
                avg = start[None, :] - rho[:, None] * (update_sum / length)[None, :]
                end_losses = 0.5 * (avg * avg) @ h
            at = {p: float(v) for p, v in zip(rho.tolist(), end_losses, strict=True)}
            exact = np.asarray([at[p] for p in points])
            # Each replica's own noisy evaluation of the points (its own batch).
            rows = exact[None, :] + problem.probe_noise * side_rng.standard_normal((replicas, len(points)))
            kappa = persistence(base[t - 1], base[-1]) if config.signal == "line" else 1.0
            line = fit_line(points, rows.mean(axis=0).tolist(), rho.tolist(), kappa, rows.tolist())
            losses = np.asarray(line.pseudo_losses)
        updates.append(
            controller.update(
                losses.tolist(),
                {"lr": rho.tolist()},
                t,
                base_values={"lr": float(base[t - 1])},
                line=line,
                train_losses=train_losses.tolist(),
            )
        )
        scales.append(controller.scale("lr"))
        if not np.all(np.isfinite(error)):
            break
    final = float(0.5 * (h * error * error).sum())
    return BudgetResult(
        start_scale,
        scales,
        lrs,
        budget_expected_loss(problem, lrs, replicas),
        best_loss,
        final if math.isfinite(final) else math.inf,
        updates,
    )
