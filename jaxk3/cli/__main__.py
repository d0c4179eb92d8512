"""`python -m jaxk3.cli ...`: the `jaxk3` command."""
import sys

from jaxk3.cli import main

sys.exit(main())
