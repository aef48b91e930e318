//! Where a model's layers get their parameters from: the [`ParamSource`] trait, and
//! [`InMemory`], the plain-candle source every parameter of which lives in candle memory
//! (the baseline that candle's own AdamW trains).
//!
//! A model written against `&mut dyn ParamSource` asks for each parameter right before
//! the layer that uses it runs, so the same forward code runs in memory and through
//! tidestore ([`crate::TideParams`]). Within one forward pass a source hands out the
//! same tensor for the same name (tied weights get one gradient).

use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};

use crate::error::{Error, Result};

pub use tidestore_train::{Loan, ParamSpec};

/// Hands a layer its parameters as candle tensors.
pub trait ParamSource {
    /// The parameter `name`, for the layer about to run. Trainable parameters come back
    /// as variables (candle tracks their gradient); frozen ones as plain tensors.
    fn param(&mut self, name: &str) -> Result<Tensor>;

    /// Parameter `name` lent for the block about to run, where the source can: its
    /// fp32 elements stay in the source's memory ([`ParamSource::lent`]) and a product
    /// reads them there, no candle tensor made. `None` (the default): ask
    /// [`ParamSource::param`].
    fn lend(&mut self, name: &str) -> Result<Option<Loan>> {
        let _ = name;
        Ok(None)
    }

    /// The elements of a loan this source made for the running block.
    fn lent(&self, loan: &Loan) -> Result<&[f32]> {
        Err(Error::BadParam {
            name: String::new(),
            reason: format!("loan {} was not made by this source", loan.id),
        })
    }
}

/// Checks that `values` fits `spec` and that no name is used twice.
pub(crate) fn check_params(params: &[(ParamSpec, Vec<f32>)]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for (spec, values) in params {
        if !seen.insert(spec.name.as_str()) {
            return Err(Error::BadParam {
                name: spec.name.clone(),
                reason: "registered twice".into(),
            });
        }
        if values.len() != spec.elements() {
            return Err(Error::BadParam {
                name: spec.name.clone(),
                reason: format!(
                    "{} initial values for shape {:?} ({} elements)",
                    values.len(),
                    spec.shape,
                    spec.elements()
                ),
            });
        }
    }
    Ok(())
}

/// Every parameter in candle memory: trainable ones as [`Var`]s (hand
/// [`InMemory::vars`] to `candle_nn::AdamW`), frozen ones as tensors.
#[derive(Debug)]
pub struct InMemory {
    params: HashMap<String, (Tensor, Option<Var>)>,
    trainable: Vec<Var>,
}

impl InMemory {
    /// Copies `params` (spec, initial values) onto `device`.
    pub fn new(params: &[(ParamSpec, Vec<f32>)], device: &Device) -> Result<Self> {
        check_params(params)?;
        let mut map = HashMap::with_capacity(params.len());
        let mut trainable = Vec::new();
        for (spec, values) in params {
            let entry = if spec.trainable {
                let var = Var::from_vec(values.clone(), spec.shape.as_slice(), device)?;
                trainable.push(var.clone());
                (var.as_tensor().clone(), Some(var))
            } else {
                (
                    Tensor::from_vec(values.clone(), spec.shape.as_slice(), device)?,
                    None,
                )
            };
            map.insert(spec.name.clone(), entry);
        }
        Ok(InMemory {
            params: map,
            trainable,
        })
    }

    /// The trainable parameters, in registration order.
    pub fn vars(&self) -> Vec<Var> {
        self.trainable.clone()
    }

    /// A parameter's current values.
    pub fn values(&self, name: &str) -> Result<Vec<f32>> {
        let (t, _) = self.params.get(name).ok_or_else(|| Error::UnknownParam {
            name: name.to_string(),
        })?;
        Ok(t.flatten_all()?.to_vec1::<f32>()?)
    }
}

impl ParamSource for InMemory {
    fn param(&mut self, name: &str) -> Result<Tensor> {
        match self.params.get(name) {
            // A Var's tensor shares its storage: `Var::set` by the optimizer shows here.
            Some((_, Some(var))) => Ok(var.as_tensor().clone()),
            Some((t, None)) => Ok(t.clone()),
            None => Err(Error::UnknownParam {
                name: name.to_string(),
            }),
        }
    }
}
