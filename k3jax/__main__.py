"""`python -m k3jax` is the `k3jax` command."""

from k3jax.cli import main

raise SystemExit(main())
