"""``python -m hintflow``: the same CLI as the ``hintflow`` console script."""

from hintflow.cli import main

if __name__ == "__main__":
    main()
