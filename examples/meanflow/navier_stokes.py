"""A small pseudo-spectral solver for 2-D incompressible Navier–Stokes in vorticity form.

    dw/dt + u·grad(w) = nu * lap(w) + f,      u = (d_y psi, -d_x psi),   -lap(psi) = w

on the periodic unit square, with the forcing of Li et al. (FNO, 2021):
f(x, y) = 0.1 (sin 2pi(x+y) + cos 2pi(x+y)), and initial vorticity drawn from the Gaussian
random field N(0, 7^{3/2} (-lap + 49 I)^{-2.5}) used there.

Time stepping: Crank–Nicolson for the viscous term, Heun (explicit RK2) for advection and forcing,
2/3-rule dealiasing of the nonlinear term. All trajectories of a batch are advanced together.

    python examples/meanflow/navier_stokes.py   # prints the data set's shape and statistics
"""
from __future__ import annotations

import math
import time

import torch


def gaussian_random_field(n: int, size: int, generator: torch.Generator,
                          alpha: float = 2.5, tau: float = 7.0) -> torch.Tensor:
    """Samples of N(0, tau^(2 alpha - 2) ... (-lap + tau^2)^-alpha) on a size x size periodic grid,
    as in Li et al.; mean zero. Returns [n, size, size] float64."""
    k = torch.fft.fftfreq(size, d=1.0 / size, dtype=torch.float64)
    kx, ky = torch.meshgrid(k, k, indexing="ij")
    sigma = tau ** (0.5 * (2 * alpha - 2))
    sqrt_eig = size ** 2 * math.sqrt(2.0) * sigma * ((4 * math.pi ** 2) * (kx ** 2 + ky ** 2) + tau ** 2) ** (-alpha / 2)
    sqrt_eig[0, 0] = 0.0
    coeff = torch.randn(n, size, size, 2, dtype=torch.float64, generator=generator)
    coeff = torch.view_as_complex(coeff) * sqrt_eig
    return torch.fft.ifft2(coeff).real


def li_forcing(size: int) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) / size
    X, Y = torch.meshgrid(x, x, indexing="ij")
    return 0.1 * (torch.sin(2 * math.pi * (X + Y)) + torch.cos(2 * math.pi * (X + Y)))


def simulate(w0: torch.Tensor, forcing: torch.Tensor, visc: float, t_snapshots, dt: float) -> torch.Tensor:
    """Advance vorticity w0 [n, N, N] and return the fields at the (sorted) times t_snapshots:
    [n, len(t_snapshots), N, N]."""
    N = w0.shape[-1]
    k = torch.fft.fftfreq(N, d=1.0 / N, dtype=torch.float64)             # integer wavenumbers
    kx, ky = torch.meshgrid(k, k[: N // 2 + 1], indexing="ij")           # rfft2 layout
    two_pi = 2 * math.pi
    lap = -(two_pi ** 2) * (kx ** 2 + ky ** 2)                           # symbol of the Laplacian
    inv_lap = torch.where(lap == 0, torch.zeros_like(lap), 1.0 / torch.where(lap == 0, torch.ones_like(lap), lap))
    dealias = ((kx.abs() <= N / 3) & (ky.abs() <= N / 3)).to(torch.float64)
    ikx, iky = 1j * two_pi * kx, 1j * two_pi * ky
    f_h = torch.fft.rfft2(forcing)

    def rhs(w_h):
        """Fourier transform of -u·grad(w) + f (dealiased)."""
        psi_h = -w_h * inv_lap                                          # -lap psi = w
        u = torch.fft.irfft2(iky * psi_h, s=(N, N))                     # u =  d_y psi
        v = torch.fft.irfft2(-ikx * psi_h, s=(N, N))                    # v = -d_x psi
        wx = torch.fft.irfft2(ikx * w_h, s=(N, N))
        wy = torch.fft.irfft2(iky * w_h, s=(N, N))
        return -torch.fft.rfft2(u * wx + v * wy) * dealias + f_h

    cn_plus, cn_minus = 1 + 0.5 * dt * visc * lap, 1 - 0.5 * dt * visc * lap
    w_h = torch.fft.rfft2(w0)
    out, t = [], 0.0
    for t_snap in sorted(t_snapshots):
        steps = int(round((t_snap - t) / dt))
        for _ in range(steps):
            n1 = rhs(w_h)
            w_pred = (cn_plus * w_h + dt * n1) / cn_minus
            n2 = rhs(w_pred)
            w_h = (cn_plus * w_h + 0.5 * dt * (n1 + n2)) / cn_minus
        t += steps * dt
        out.append(torch.fft.irfft2(w_h, s=(N, N)))
    return torch.stack(out, 1)


def make_dataset(n_traj: int = 32, snapshots: int = 10, resolution: int = 32, seed: int = 0,
                 visc: float = 1e-3, t_start: float = 2.0, t_every: float = 0.5,
                 oversample: int = 1, dt: float = 0.0) -> torch.Tensor:
    """n_traj * snapshots vorticity fields [M, 1, resolution, resolution] (float32), each the
    state at t = t_start, t_start + t_every, ... of a trajectory from its own random initial
    condition. Solved on a grid `oversample` times finer, then subsampled. dt 0: 1/(8 N) on the
    N x N solver grid (advective CFL ~ 0.1 for these O(1) velocities)."""
    if not dt:
        dt = 1.0 / (8 * resolution * oversample)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # small FFTs: one thread is as fast, and never stalls on a busy machine
    try:
        return _make_dataset(n_traj, snapshots, resolution, seed, visc, t_start, t_every, oversample, dt)
    finally:
        torch.set_num_threads(threads)


def _make_dataset(n_traj, snapshots, resolution, seed, visc, t_start, t_every, oversample, dt):
    g = torch.Generator().manual_seed(seed)
    n_fine = resolution * oversample
    w0 = gaussian_random_field(n_traj, n_fine, g)
    times = [t_start + i * t_every for i in range(snapshots)]
    w = simulate(w0, li_forcing(n_fine), visc, times, dt)
    w = w[..., ::oversample, ::oversample]
    return w.reshape(-1, 1, resolution, resolution).float()


if __name__ == "__main__":
    t0 = time.perf_counter()
    data = make_dataset()
    print(f"{tuple(data.shape)} in {time.perf_counter() - t0:.1f}s; mean {data.mean():.3f} "
          f"std {data.std():.3f} min {data.min():.3f} max {data.max():.3f} finite {bool(data.isfinite().all())}")
