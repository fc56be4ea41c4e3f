"""Context parallelism (K3_SYSTEMS §7): ``kcp`` (KCP for KDA: the state-transition scan across ranks), ``ops`` (the
differentiable collectives and MLA's context-parallel attention), ``context`` (the attention context a CP rank's
layers see)."""
