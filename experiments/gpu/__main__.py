from experiments.common import dispatch

dispatch.main("experiments.gpu")
