"""``python -m tf_dpadambc``: the main job (see :mod:`tf_dpadambc.main`)."""
import sys

from tf_dpadambc.main import main

if __name__ == "__main__":
  sys.exit(main())
