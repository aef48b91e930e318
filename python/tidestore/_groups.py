"""What ``tidestore.AdamW`` and the optimizer of ``tidestore.offload`` share as
``torch.optim.Optimizer``s over one store.

- **One set of hyper-parameters.** The store steps every parameter with one ``lr``,
  ``betas``, ``eps`` and ``weight_decay``: every param group must hold the same values
  (a group that differs is refused, naming it and the key). They are read from
  ``param_groups`` before every step, so a scheduler (``OneCycleLR`` cycles the betas
  too), an edit of ``param_groups`` or ``load_state_dict`` takes effect at the next step,
  as with ``torch.optim.AdamW``.
- **Parameters fixed when the optimizer is made**: the store's layout holds them;
  ``add_param_group`` is refused.
- **No copy**: the state lives in the store (a host pool, a swap file), which neither
  ``pickle`` nor ``copy.deepcopy`` can carry; both are refused. ``state_dict()`` writes
  it to a checkpoint file.
- Keywords of ``torch.optim.AdamW`` that tidestore does not implement (``amsgrad``,
  ``maximize``, ``foreach``, ``fused``, ``capturable``, ``differentiable``) are taken at
  torch's defaults, so code written for torch runs unchanged, and refused otherwise.
"""

import numbers

import torch

# torch.optim.AdamW's keywords tidestore does not implement, with the value that means
# "off" (None: torch's own choice of implementation).
TORCH_ONLY = {"amsgrad": False, "maximize": False, "capturable": False,
              "differentiable": False, "foreach": None, "fused": None}


def check_torch_only(kwargs, who):
    """Accepts torch.optim.AdamW's keywords at their off values; refuses the rest."""
    for key, value in kwargs.items():
        if key not in TORCH_ONLY:
            raise TypeError(f"{who}: unexpected keyword argument {key!r}")
        off = TORCH_ONLY[key]
        if value != off and not (off is None and value is False):
            raise ValueError(f"{who}: {key}={value!r} is not supported (only {off!r}): "
                             "tidestore steps with its own AdamW kernels")


def check_threads(threads):
    """``threads``: the step's CPU threads, 0 for every core."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads: {threads!r} is not a thread count (0: every core)")


def _number(where, v):
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point():
        return float(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{where} = {v!r}: expected a real number")
    return float(v)


def _group_values(k, g):
    where = f"param_groups[{k}]"
    betas = g["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{where}['betas'] = {betas!r}: expected two numbers")
    return (_number(f"{where}['lr']", g["lr"]),
            tuple(_number(f"{where}['betas']", b) for b in betas),
            _number(f"{where}['eps']", g["eps"]),
            _number(f"{where}['weight_decay']", g["weight_decay"]))


def hyper_params(param_groups, who):
    """``(lr, (beta1, beta2), eps, weight_decay)``, the same in every group (checked)."""
    first = _group_values(0, param_groups[0])
    for k, g in enumerate(param_groups[1:], 1):
        values = _group_values(k, g)
        for key, mine, theirs in zip(("lr", "betas", "eps", "weight_decay"), values, first):
            if mine != theirs:
                raise ValueError(
                    f"param_groups[{k}]['{key}'] = {g[key]!r} differs from group 0's "
                    f"{param_groups[0][key]!r}: {who} steps every parameter with one set "
                    "of hyper-parameters")
    return first


class StoreOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose parameters and state live in a tidestore store
    (see the module doc). Subclasses call ``_seal()`` once their store holds the
    parameters, and ``_sync_hyper(core)`` before each step."""

    _sealed = False
    _applied = None

    def _seal(self):
        self._sealed = True

    def add_param_group(self, param_group):
        if self._sealed:
            raise ValueError(
                f"add_param_group: {type(self).__name__}'s parameters are fixed when it is "
                "made (its store's layout holds them); make the optimizer with every "
                "parameter")
        super().add_param_group(param_group)

    def _sync_hyper(self, core):
        """Hands ``core`` the groups' hyper-parameters (checked alike in every group)
        when they differ from those it last took."""
        hp = hyper_params(self.param_groups, type(self).__name__)
        if hp != self._applied:
            core.set_hyper_params(*hp)
            self._applied = hp

    def __getstate__(self):
        raise TypeError(
            f"{type(self).__name__} cannot be pickled or copied: its state lives in a "
            "tidestore store; save it with state_dict() (a checkpoint file) and load it "
            "into a new optimizer")
