//! Rotary position embeddings as Hugging Face configs describe them: the `rope_type`
//! (`default`, `linear`, `llama3`, `yarn`) with its parameters, read from either
//! spelling — transformers 4's top-level `rope_theta` + `rope_scaling`, or transformers
//! ≥ 5's `rope_parameters` — and the inverse frequencies and attention factor that
//! transformers' `modeling_rope_utils` computes from them (written here from its
//! published formulas, in f32 as torch computes them).
//!
//! Invariant of a [`Rope`]: θ is finite and > 0, every factor is finite and > 0, and
//! the type is one tidestore computes; anything else is refused by
//! [`TrainError::HfConfig`] naming the file and the key (`rope_scaling.rope_type`,
//! `rope_parameters.factor`, …), never dropped.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Result, TrainError};

/// θ when a config names none (transformers' default).
pub const DEFAULT_ROPE_THETA: f64 = 10_000.0;

/// How the rotary frequencies are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: `θ^(-2j/d)`.
    Default,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.1's wavelength-banded scaling.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// `low_freq_factor`.
        low_freq_factor: f64,
        /// `high_freq_factor`.
        high_freq_factor: f64,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: f64,
    },
    /// YaRN: interpolation ramped between extrapolated and interpolated frequencies,
    /// with an attention factor on `cos` and `sin`.
    Yarn {
        /// `factor`.
        factor: f64,
        /// `original_max_position_embeddings` (the config's `max_position_embeddings`
        /// when absent).
        original_max_position_embeddings: f64,
        /// `beta_fast` (32 when absent).
        beta_fast: f64,
        /// `beta_slow` (1 when absent).
        beta_slow: f64,
        /// `attention_factor`, or the one computed from `mscale` / `mscale_all_dim`.
        attention_factor: f64,
        /// `truncate` (true when absent): round the correction range outward.
        truncate: bool,
    },
}

/// The RoPE of a model: θ and the scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// `rope_theta`.
    pub theta: f64,
    /// `rope_type` and its parameters.
    pub scaling: RopeScaling,
}

impl Default for Rope {
    fn default() -> Self {
        Rope {
            theta: DEFAULT_ROPE_THETA,
            scaling: RopeScaling::Default,
        }
    }
}

/// The rope types tidestore computes, as the refusal names them.
const SUPPORTED: &str = "default, linear, llama3, yarn";

/// `scale` > 1: YaRN's `0.1 · mscale · ln(scale) + 1`; 1 otherwise.
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl Rope {
    /// Reads the RoPE of a config object: `rope_parameters` when present (transformers
    /// ≥ 5; then a top-level `rope_theta` or non-null `rope_scaling` must agree or be
    /// absent), else `rope_theta` and `rope_scaling`. `max_position` is the config's
    /// `max_position_embeddings` (YaRN's default original length).
    pub fn from_config(raw: &Map<String, Value>, max_position: usize, path: &Path) -> Result<Rope> {
        let err = |key: &str, reason: String| TrainError::HfConfig {
            path: path.to_path_buf(),
            key: key.to_string(),
            reason,
        };
        let top_theta = match raw.get("rope_theta") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_f64()
                    .ok_or_else(|| err("rope_theta", format!("{v} is not a number")))?,
            ),
        };
        let scaling = raw.get("rope_scaling").filter(|v| !v.is_null());
        let Some(params) = raw.get("rope_parameters").filter(|v| !v.is_null()) else {
            let theta = top_theta.unwrap_or(DEFAULT_ROPE_THETA);
            let scaling = match scaling {
                None => RopeScaling::Default,
                Some(s) => parse_scaling(s, "rope_scaling", max_position, &err)?,
            };
            return Rope::checked(theta, scaling, "rope_theta", &err);
        };
        if scaling.is_some() {
            return Err(err(
                "rope_scaling",
                "given beside rope_parameters: say the RoPE once (rope_parameters)".into(),
            ));
        }
        let obj = params
            .as_object()
            .ok_or_else(|| err("rope_parameters", format!("{params} is not an object")))?;
        let theta = match obj.get("rope_theta") {
            None => top_theta.unwrap_or(DEFAULT_ROPE_THETA),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| err("rope_parameters.rope_theta", format!("{v} is not a number")))?,
        };
        if let Some(t) = top_theta.filter(|t| *t != theta) {
            return Err(err(
                "rope_theta",
                format!("{t} disagrees with rope_parameters.rope_theta = {theta}"),
            ));
        }
        let scaling = parse_scaling(params, "rope_parameters", max_position, &err)?;
        Rope::checked(theta, scaling, "rope_parameters.rope_theta", &err)
    }

    fn checked(
        theta: f64,
        scaling: RopeScaling,
        theta_key: &str,
        err: &impl Fn(&str, String) -> TrainError,
    ) -> Result<Rope> {
        if !(theta.is_finite() && theta > 0.0) {
            return Err(err(theta_key, format!("{theta} is not a positive number")));
        }
        Ok(Rope { theta, scaling })
    }

    /// The inverse frequencies of a head of `head_dim` (even): `head_dim / 2` values, in
    /// f32 as transformers computes them.
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        assert!(
            head_dim >= 2 && head_dim.is_multiple_of(2),
            "head_dim {head_dim}"
        );
        let d = head_dim as f32;
        let theta = self.theta as f32;
        let base: Vec<f32> = (0..head_dim)
            .step_by(2)
            .map(|j| 1.0 / theta.powf(j as f32 / d))
            .collect();
        match &self.scaling {
            RopeScaling::Default => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / *factor as f32).collect(),
            RopeScaling::Llama3 { .. } => self.llama3_inv_freq(&base),
            RopeScaling::Yarn { .. } => self.yarn_inv_freq(&base, head_dim),
        }
    }

    /// Llama 3.1's bands: high frequencies kept, low ones divided by `factor`, the
    /// medium ones smoothly between.
    fn llama3_inv_freq(&self, base: &[f32]) -> Vec<f32> {
        let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } = self.scaling
        else {
            unreachable!("called for llama3 scaling only")
        };
        let (factor, low, high, old) = (
            factor as f32,
            low_freq_factor as f32,
            high_freq_factor as f32,
            original_max_position_embeddings as f32,
        );
        let (low_wavelen, high_wavelen) = (old / low, old / high);
        base.iter()
            .map(|&f| {
                let wavelen = 2.0 * std::f32::consts::PI / f;
                let scaled = if wavelen > low_wavelen { f / factor } else { f };
                if wavelen < high_wavelen || wavelen > low_wavelen {
                    scaled
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * scaled / factor + smooth * scaled
                }
            })
            .collect()
    }

    /// YaRN: extrapolated frequencies below the correction range, interpolated ones
    /// (divided by `factor`) above it, a linear ramp between.
    fn yarn_inv_freq(&self, base: &[f32], head_dim: usize) -> Vec<f32> {
        let RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } = self.scaling
        else {
            unreachable!("called for yarn scaling only")
        };
        let dim = head_dim as f64;
        let correction = |rotations: f64| {
            dim * (original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * self.theta.ln())
        };
        let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
        if truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0) as f32, high.min(dim - 1.0) as f32);
        if low == high {
            high += 0.001;
        }
        let (factor, theta, d) = (factor as f32, self.theta as f32, head_dim as f32);
        base.iter()
            .enumerate()
            .map(|(j, &extrapolated)| {
                let ramp = ((j as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                let interpolated = 1.0 / (factor * theta.powf((2 * j) as f32 / d));
                interpolated * (1.0 - keep) + extrapolated * keep
            })
            .collect()
    }

    /// The factor on `cos` and `sin` (YaRN's attention scaling; 1 otherwise).
    pub fn attention_factor(&self) -> f64 {
        match &self.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }

    /// Whether positions beyond `max_position_embeddings` are what the scaling is for.
    pub fn is_scaled(&self) -> bool {
        self.scaling != RopeScaling::Default
    }
}

/// The keys a scaling object may hold besides its type's own.
const COMMON_KEYS: [&str; 4] = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];

fn parse_scaling(
    v: &Value,
    at: &str,
    max_position: usize,
    err: &impl Fn(&str, String) -> TrainError,
) -> Result<RopeScaling> {
    let obj = v
        .as_object()
        .ok_or_else(|| err(at, format!("{v} is not an object")))?;
    let kind = match (obj.get("rope_type"), obj.get("type")) {
        (Some(a), Some(b)) if a != b => {
            return Err(err(
                &format!("{at}.rope_type"),
                format!("{a} disagrees with {at}.type = {b}"),
            ))
        }
        (Some(t), _) | (None, Some(t)) => t
            .as_str()
            .ok_or_else(|| err(&format!("{at}.rope_type"), format!("{t} is not a string")))?,
        (None, None) => return Err(err(&format!("{at}.rope_type"), "missing".into())),
    };
    let (own, scaling) = of_type(kind, obj, at, max_position, err)?;
    if let Some(p) = obj
        .get("partial_rotary_factor")
        .filter(|p| p.as_f64() != Some(1.0))
    {
        return Err(err(
            &format!("{at}.partial_rotary_factor"),
            format!("{p} is not supported: tidestore rotates the whole head (1.0)"),
        ));
    }
    if let Some(k) = obj
        .keys()
        .find(|k| !COMMON_KEYS.contains(&k.as_str()) && !own.contains(&k.as_str()))
    {
        return Err(err(
            &format!("{at}.{k}"),
            format!("not a parameter of rope_type `{kind}`; tidestore would ignore it"),
        ));
    }
    Ok(scaling)
}

/// The scaling of `kind` and the keys its parameters may use.
fn of_type(
    kind: &str,
    obj: &Map<String, Value>,
    at: &str,
    max_position: usize,
    err: &impl Fn(&str, String) -> TrainError,
) -> Result<(&'static [&'static str], RopeScaling)> {
    Ok(match kind {
        "default" => (&[], RopeScaling::Default),
        "linear" => (
            &["factor"],
            RopeScaling::Linear {
                factor: number(obj, at, "factor", None, err)?,
            },
        ),
        "llama3" => (
            &[
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ],
            llama3(obj, at, max_position, err)?,
        ),
        "yarn" => (
            &[
                "factor",
                "original_max_position_embeddings",
                "beta_fast",
                "beta_slow",
                "attention_factor",
                "mscale",
                "mscale_all_dim",
                "truncate",
            ],
            yarn(obj, at, max_position, err)?,
        ),
        other => {
            return Err(err(
                &format!("{at}.rope_type"),
                format!("`{other}` is not supported; tidestore computes {SUPPORTED}"),
            ))
        }
    })
}

/// A positive finite number at `at.key`, or `default` when absent.
fn number(
    obj: &Map<String, Value>,
    at: &str,
    key: &str,
    default: Option<f64>,
    err: &impl Fn(&str, String) -> TrainError,
) -> Result<f64> {
    finite(obj, at, key, default, POSITIVE, err)
}

/// What a number must be: the test of a finite value, and its words for the error.
type Want = (fn(f64) -> bool, &'static str);
const POSITIVE: Want = (|x| x > 0.0, "a positive number");
const NON_NEGATIVE: Want = (|x| x >= 0.0, "a number ≥ 0");

/// A finite number at `at.key` that passes `want`, or `default` when absent.
fn finite(
    obj: &Map<String, Value>,
    at: &str,
    key: &str,
    default: Option<f64>,
    (ok, words): Want,
    err: &impl Fn(&str, String) -> TrainError,
) -> Result<f64> {
    let full = format!("{at}.{key}");
    match obj.get(key).filter(|v| !v.is_null()) {
        None => default.ok_or_else(|| err(&full, "missing".into())),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && ok(x) => Ok(x),
            _ => Err(err(&full, format!("{v} is not {words}"))),
        },
    }
}

/// `original_max_position_embeddings` at `at`, the model's `max_position` when absent.
fn original_max(
    obj: &Map<String, Value>,
    at: &str,
    max_position: usize,
    err: &impl Fn(&str, String) -> TrainError,
) -> Result<f64> {
    let key = "original_max_position_embeddings";
    number(obj, at, key, Some(max_position as f64), err)
}

fn llama3(
    obj: &Map<String, Value>,
    at: &str,
    max_position: usize,
    err: &impl Fn(&str, String) -> TrainError,
) -> Result<RopeScaling> {
    let low_freq_factor = number(obj, at, "low_freq_factor", None, err)?;
    let high_freq_factor = number(obj, at, "high_freq_factor", None, err)?;
    if high_freq_factor <= low_freq_factor {
        return Err(err(
            &format!("{at}.high_freq_factor"),
            format!("{high_freq_factor} must exceed low_freq_factor = {low_freq_factor}"),
        ));
    }
    Ok(RopeScaling::Llama3 {
        factor: number(obj, at, "factor", None, err)?,
        low_freq_factor,
        high_freq_factor,
        original_max_position_embeddings: original_max(obj, at, max_position, err)?,
    })
}

fn yarn(
    obj: &Map<String, Value>,
    at: &str,
    max_position: usize,
    err: &impl Fn(&str, String) -> TrainError,
) -> Result<RopeScaling> {
    let factor = number(obj, at, "factor", None, err)?;
    let attention_factor = match obj.get("attention_factor").filter(|v| !v.is_null()) {
        Some(_) => number(obj, at, "attention_factor", None, err)?,
        None => {
            // transformers uses mscale / mscale_all_dim only when both are non-zero.
            let mscale = finite(obj, at, "mscale", Some(0.0), NON_NEGATIVE, err)?;
            let all = finite(obj, at, "mscale_all_dim", Some(0.0), NON_NEGATIVE, err)?;
            if mscale != 0.0 && all != 0.0 {
                yarn_mscale(factor, mscale) / yarn_mscale(factor, all)
            } else {
                yarn_mscale(factor, 1.0)
            }
        }
    };
    let truncate = match obj.get("truncate") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(err(&format!("{at}.truncate"), format!("{v} is not a bool"))),
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: original_max(obj, at, max_position, err)?,
        beta_fast: number(obj, at, "beta_fast", Some(32.0), err)?,
        beta_slow: number(obj, at, "beta_slow", Some(1.0), err)?,
        attention_factor,
        truncate,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: serde_json::Value, max_position: usize) -> Result<Rope> {
        let Value::Object(m) = json else {
            unreachable!()
        };
        Rope::from_config(&m, max_position, Path::new("m/config.json"))
    }

    /// `json` read for a model of 131,072 positions, its `inv_freq` for heads of 128
    /// checked against `want` (index, transformers' value) to 1e-6 relative.
    fn read_close(json: serde_json::Value, want: &[(usize, f32)]) -> Rope {
        let r = read(json, 131_072).unwrap();
        let got = r.inv_freq(128);
        for &(i, w) in want {
            let rel = (got[i] - w).abs() / w.abs();
            assert!(rel <= 1e-6, "inv_freq[{i}] = {} not {w}", got[i]);
        }
        r
    }

    /// The values transformers 5.24's `ROPE_INIT_FUNCTIONS` gives for Llama 3.1 8B.
    #[test]
    fn llama3_frequencies_equal_transformers() {
        let r = read_close(
            serde_json::json!({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3",
              "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}}),
            &[
                (0, 1.0),
                (20, 0.016_560_44),
                (40, 3.428_102_4e-5),
                (63, 3.068_926e-7),
            ],
        );
        assert_eq!(r.attention_factor(), 1.0);
    }

    /// The values transformers 5.24 gives for Qwen2.5-7B's YaRN setting.
    #[test]
    fn yarn_frequencies_and_factor_equal_transformers() {
        let r = read_close(
            serde_json::json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6,
              "factor": 4.0, "original_max_position_embeddings": 32768}}),
            &[
                (0, 1.0),
                (20, 0.013_335_215),
                (40, 4.445_698_5e-5),
                (63, 3.102_344_4e-7),
            ],
        );
        assert!((r.attention_factor() - 1.138_629_436_111_989).abs() < 1e-12);
    }

    #[test]
    fn linear_divides_and_default_is_plain() {
        let plain = read(serde_json::json!({"rope_theta": 10000.0}), 2048).unwrap();
        let lin = read(
            serde_json::json!({"rope_scaling": {"type": "linear", "factor": 4.0}}),
            2048,
        )
        .unwrap();
        let (p, l) = (plain.inv_freq(8), lin.inv_freq(8));
        assert_eq!(p[1], 0.1);
        for (a, b) in p.iter().zip(&l) {
            assert_eq!(a / 4.0, *b);
        }
    }

    #[test]
    fn refuses_by_name_what_it_does_not_compute() {
        for (json, key) in [
            (
                serde_json::json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
                "rope_scaling.rope_type",
            ),
            (
                serde_json::json!({"rope_parameters": {"rope_type": "longrope"}}),
                "rope_parameters.rope_type",
            ),
            (
                serde_json::json!({"rope_parameters": {"rope_type": "linear"}}),
                "rope_parameters.factor",
            ),
            (
                serde_json::json!({"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                  "low_freq_factor": 1.0}}),
                "rope_parameters.low_freq_factor",
            ),
            (
                serde_json::json!({"rope_theta": 1e4,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
                "rope_theta",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                  "rope_parameters": {"rope_type": "default"}}),
                "rope_scaling",
            ),
            (serde_json::json!({"rope_theta": -1.0}), "rope_theta"),
        ] {
            match read(json.clone(), 2048) {
                Err(TrainError::HfConfig { key: k, .. }) => assert_eq!(k, key, "{json}"),
                other => panic!("{json}: {other:?}"),
            }
        }
    }
}
