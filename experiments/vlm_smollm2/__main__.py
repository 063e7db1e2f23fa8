from experiments.vlm_smollm2 import study

study.main()
