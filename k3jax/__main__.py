import sys

from k3jax.cli import main

sys.exit(main())
