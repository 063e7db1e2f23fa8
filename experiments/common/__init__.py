"""What the scenes-QA studies (token_budget, native, vlm_smollm2) share: question features from a
frozen tower (``qa_features``), the connector + small LM trained on them (``feature_vlm``), the
pinned tower (``tower``), and the ``python -m experiments.<study> NAME`` dispatch (``dispatch``)."""
