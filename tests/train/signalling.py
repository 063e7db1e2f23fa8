"""A training input wrapped so that something happens while batch N is fetched: the process
sends itself a signal (a real one, at a known step). Imported by the tests' subprocess scripts."""

import os
import signal


def send_at_batch(batch: int, sig: str = "SIGTERM") -> None:
    """From now on, ``trainer.train`` sends ``sig`` to this process while fetching batch ``batch``."""
    from vitmm.train import inputs

    make = inputs.make

    def wrapped(*args):
        it = make(*args)

        class Signalling:
            count = 0

            def __next__(self):
                Signalling.count += 1
                if Signalling.count == batch:
                    for name in sig.split(","):  # e.g. "SIGINT,SIGINT": Ctrl-C twice
                        os.kill(os.getpid(), getattr(signal, name))
                return next(it)

            def get_state(self):
                return it.get_state()

            def set_state(self, state):
                it.set_state(state)

        return Signalling()

    inputs.make = wrapped
