"""Rule resolution: flax-linen ordered semantics and one-paragraph errors naming the culprit."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxscale.errors import RulesError
from jaxscale.mesh import make_mesh
from jaxscale.rules import AxisRules, logical_to_mesh_axes, normalize_rules


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


@pytest.mark.parametrize("logical, rules, expected", [
    (("embed", "mlp"), [("embed", "fsdp"), ("mlp", "tensor")], ["fsdp", "tensor"]),
    (("batch", "embed"), [("batch", ("data", "fsdp")), ("embed", "fsdp")], [("data", "fsdp"), None]),
    (("embed", "mlp"), [("embed", None), ("mlp", "tensor")], [None, "tensor"]),
    (("embed", "unknown"), [("embed", "fsdp")], ["fsdp", None]),
    # MaxText-style fallback: first rule's axes are taken by mlp, so embed falls back to fsdp.
    (("mlp", "embed"), [("mlp", "tensor"), ("embed", ("fsdp", "tensor")), ("embed", "fsdp")],
     ["tensor", "fsdp"]),
    (("embed", "mlp"), [("embed", ("fsdp", "tensor")), ("embed", "fsdp"), ("mlp", "tensor")],
     [("fsdp", "tensor"), None]),
    # Rules order, not dimension order, decides who gets a contested mesh axis.
    (("embed", "mlp"), [("mlp", "tensor"), ("embed", "tensor")], [None, "tensor"]),
    ((None, "embed"), [("embed", "fsdp")], [None, "fsdp"]),
])
def test_resolution_table(logical, rules, expected):
    assert logical_to_mesh_axes(logical, normalize_rules(rules)) == expected


def test_spec_and_replicated_unmatched(mesh):
    rules = AxisRules(normalize_rules([("embed", "fsdp"), ("mlp", "tensor")]))
    assert rules.spec(("embed", "mlp"), (8, 16), mesh) == P("fsdp", "tensor")
    assert rules.spec(("vocab", "embed"), (10, 8), mesh) == P(None, "fsdp")


def test_unknown_mesh_axis_names_param_and_axes(mesh):
    rules = AxisRules(normalize_rules([("embed", "model")]))
    with pytest.raises(RulesError) as e:
        rules.spec(("embed",), (8,), mesh, path="layers/attn/wq")
    msg = str(e.value)
    for part in ("layers/attn/wq", "(8,)", "'model'", "embed", "data"):
        assert part in msg


def test_indivisible_error_and_replicate(mesh):
    strict = AxisRules(normalize_rules([("mlp", ("fsdp", "tensor"))]))
    with pytest.raises(RulesError) as e:
        strict.spec(("mlp",), (6,), mesh, path="mlp/w_up")
    assert "mlp/w_up" in str(e.value) and "6" in str(e.value)
    assert "--config.rules_indivisible=replicate" in str(e.value)
    lenient = AxisRules(strict.rules, indivisible="replicate")
    with pytest.warns(UserWarning, match="mlp/w_up"):
        assert lenient.spec(("mlp",), (6,), mesh, path="mlp/w_up") == P("fsdp")


def test_activation_spec_is_lenient_whatever_the_rules_policies(mesh):
    """Activations drop indivisible mesh axes and replicate unknown names without a warning,
    even under strict rules with indivisible='error' (which hold parameters to them)."""
    import warnings
    rules = AxisRules(normalize_rules([("batch", ("data", "fsdp")), ("mlp", "tensor")]),
                      strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 6 rows: data=2 divides them, data x fsdp = 4 does not
        assert rules.activation_spec(("batch", "mlp"), (6, 16), mesh) == P("data", "tensor")
        assert rules.activation_spec(("batch", "heads"), (8, 3), mesh) == P(("data", "fsdp"), None)
    with pytest.raises(RulesError):
        rules.spec(("batch", "mlp"), (6, 16), mesh)


def test_rules_without_an_axis_and_extended_by_one(mesh):
    from jaxscale.rules import as_tuple, from_tuple
    rules = AxisRules(normalize_rules([("batch", ("data", "fsdp")), ("embed", "data"),
                                       ("mlp", "tensor"), ("length", None)]),
                      strict=True, indivisible="replicate")
    assert rules.without("data") == AxisRules(
        (("batch", "fsdp"), ("embed", None), ("mlp", "tensor"), ("length", None)),
        strict=True, indivisible="replicate")
    assert rules.extended("batch", "tensor").rules[0] == ("batch", ("data", "fsdp", "tensor"))
    assert rules.extended("length", "tensor").rules[3] == ("length", "tensor")
    assert rules.extended("batch", "fsdp") == rules  # already there
    assert [from_tuple(as_tuple(a)) for a in (None, "x", ("x",), ("x", "y"))] == [
        None, "x", "x", ("x", "y")]


def test_strict_requires_every_name_covered(mesh):
    rules = AxisRules(normalize_rules([("embed", "fsdp"), ("norm", None)]), strict=True)
    assert rules.spec(("norm",), (8,), mesh) == P(None)
    with pytest.raises(RulesError, match="'heads'.*rules_strict"):
        rules.spec(("embed", "heads"), (8, 4), mesh, path="attn/wq")


def test_malformed_rules_and_rank_mismatch(mesh):
    with pytest.raises(RulesError, match="malformed"):
        normalize_rules([("embed",)])
    with pytest.raises(RulesError, match="one logical name"):
        AxisRules(()).spec(("embed",), (4, 4), mesh, path="w")


def test_config_rejects_bad_indivisible_mode():
    import ml_collections as mlc
    with pytest.raises(RulesError, match="rules_indivisible"):
        AxisRules.from_config(mlc.ConfigDict({"rules": [], "rules_indivisible": "drop"}))


def test_constrain_is_identity_without_rules():
    from jaxscale.rules import constrain
    x = jax.numpy.ones((4, 4))
    assert constrain(x, "batch", "embed") is x


def test_default_rules_are_the_fsdp_tp_preset(mesh):
    from jaxscale.config import DEFAULT_RULES, base_config
    from jaxscale.rules import PRESETS

    assert DEFAULT_RULES is PRESETS["fsdp_tp"]  # one table, not a copy
    c = base_config()
    assert c.rules == [tuple(r) for r in PRESETS["fsdp_tp"]] and c.rules_preset == ""
    named = base_config()
    named.rules_preset = "fsdp_tp"
    default, preset = AxisRules.from_config(c), AxisRules.from_config(named)
    for logical in (("batch", "length", "embed"), ("embed", "heads", "head_dim"),
                    ("layers", "embed", "mlp"), ("vocab", "embed"), ("mlp", "embed")):
        shape = (8,) * len(logical)
        assert default.spec(logical, shape, mesh) == preset.spec(logical, shape, mesh)


def test_a_mesh_axis_no_rule_uses_is_refused_by_validate_naming_presets_that_use_it():
    from configs import tiny_lm
    from jaxscale.config import validate
    from jaxscale.errors import ConfigError

    c = tiny_lm.get_config("test")
    c.mesh.update(data=2, fsdp=1, tensor=4, pipeline=1)
    c.rules_preset = "fsdp"
    with pytest.raises(ConfigError, match=r"The mesh axis 'tensor' has size 4 \(mesh.tensor x "
                       r"mesh.dcn_tensor\), but no rule of rules preset 'fsdp' shards anything "
                       r"over it.*\(tp, fsdp_tp, pp: --config.rules_preset=tp\).*"
                       r"--config.mesh.tensor=1\."):
        validate(c)
    c.rules_preset = "tp"
    validate(c)
