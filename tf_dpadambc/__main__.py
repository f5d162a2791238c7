"""``python -m tf_dpadambc``: the ``tf-dpadambc`` command (see
:mod:`tf_dpadambc.cli`)."""
import sys

from tf_dpadambc.cli import main

if __name__ == "__main__":
  sys.exit(main())
