//! The output paths of a fine-tuning run, checked before the model is read: the
//! checkpoint directory (made if missing, a file written into it and removed), the
//! export's parent (the export is written next to its target and renamed), and the
//! export directory neither the model directory nor inside it, nor the checkpoint
//! directory nor above it (the export replaces its target whole). A path that fails is
//! a configuration error naming the key and the path, so no step runs only to be lost
//! when its checkpoint or export cannot be written. A full disk cannot be known up
//! front; it is reported when it happens.

use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// Makes `dir` (and its parents) and proves it writable by creating and removing a file
/// in it; the error names `key`.
pub fn check_writable_dir(key: &str, dir: &Path) -> Result<()> {
    let bad = |what: &str, e: std::io::Error| {
        Error::config(key, format!("{} {what}: {e}", dir.display()))
    };
    if dir.exists() && !dir.is_dir() {
        return Err(Error::config(
            key,
            format!("{} exists and is not a directory", dir.display()),
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| bad("cannot be created", e))?;
    let probe = dir.join(format!(".tidestore-probe.{}", std::process::id()));
    std::fs::write(&probe, b"probe").map_err(|e| bad("is not writable", e))?;
    std::fs::remove_file(&probe).map_err(|e| bad("is not writable (remove)", e))
}

/// The parent folder a directory target is written in (`.` for a bare name).
pub fn parent_of(target: &Path) -> PathBuf {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// `path` made absolute and free of `.`/`..` (lexically), symbolic links resolved as
/// far as the path exists (its missing tail appended as written).
fn resolved(path: &Path) -> PathBuf {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut lexical = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                lexical.pop();
            }
            other => lexical.push(other),
        }
    }
    let mut existing = lexical.clone();
    let mut tail = Vec::new();
    while std::fs::canonicalize(&existing).is_err() {
        match (existing.file_name(), existing.parent()) {
            (Some(name), Some(parent)) => {
                tail.push(name.to_os_string());
                existing = parent.to_path_buf();
            }
            _ => return lexical,
        }
    }
    let mut out = std::fs::canonicalize(&existing).unwrap_or(existing);
    out.extend(tail.into_iter().rev());
    out
}

/// Refuses an export directory (`key`) equal to the model directory or inside it: the
/// export replaces its target whole, and would replace (or write into) the base model.
pub fn check_export_dir(key: &str, export: &Path, model: &Path) -> Result<()> {
    let (e, m) = (resolved(export), resolved(model));
    if e.starts_with(&m) {
        let how = if e == m { "is" } else { "is inside" };
        return Err(Error::config(
            key,
            format!(
                "{} {how} train.model_dir {}: the export would overwrite the model it \
                 starts from; choose a directory outside it",
                export.display(),
                model.display()
            ),
        ));
    }
    Ok(())
}

/// Refuses an export directory (`key`) that is the checkpoint directory or holds it:
/// the export replaces its target whole, and would delete the run's checkpoints (or
/// fail only after training).
pub fn check_export_off_checkpoints(key: &str, export: &Path, checkpoints: &Path) -> Result<()> {
    let (e, c) = (resolved(export), resolved(checkpoints));
    if c.starts_with(&e) {
        let how = if e == c { "is" } else { "contains" };
        return Err(Error::config(
            key,
            format!(
                "{} {how} train.checkpoint_dir {}: the export replaces its directory whole \
                 and would delete the checkpoints; choose directories apart",
                export.display(),
                checkpoints.display()
            ),
        ));
    }
    Ok(())
}

/// The checks of a run's outputs (see the module doc), before anything else is done.
pub fn check_outputs(t: &super::TrainSection) -> Result<()> {
    for (key, export) in [
        ("train.export_dir", &t.export_dir),
        ("train.export_merged", &t.export_merged),
    ] {
        if let (Some(export), Some(ck)) = (export, &t.checkpoint_dir) {
            check_export_off_checkpoints(key, export, ck)?;
        }
    }
    if let Some(dir) = &t.checkpoint_dir {
        check_writable_dir("train.checkpoint_dir", dir)?;
    }
    for (key, export) in [
        ("train.export_dir", &t.export_dir),
        ("train.export_merged", &t.export_merged),
    ] {
        let Some(export) = export else { continue };
        check_export_dir(key, export, t.model_dir()?)?;
        check_writable_dir(key, &parent_of(export))?;
        if export.exists() && !export.is_dir() {
            return Err(Error::config(
                key,
                format!("{} exists and is not a directory", export.display()),
            ));
        }
    }
    if let (Some(a), Some(m)) = (&t.export_dir, &t.export_merged) {
        if resolved(a) == resolved(m) {
            return Err(Error::config(
                "train.export_merged",
                format!(
                    "{} is train.export_dir too: each export replaces its directory whole",
                    m.display()
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_export_into_the_model_is_refused_however_spelled() {
        let d = tempfile::tempdir().unwrap();
        let model = d.path().join("model");
        std::fs::create_dir(&model).unwrap();
        for bad in [
            model.clone(),
            model.join("out"),
            d.path().join("x/../model/."),
        ] {
            let e = check_export_dir("train.export_dir", &bad, &model).unwrap_err();
            assert_eq!(e.key(), Some("train.export_dir"), "{bad:?}");
        }
        check_export_dir("train.export_dir", &d.path().join("model-out"), &model).unwrap();
        check_export_dir("train.export_merged", &d.path().join("export"), &model).unwrap();
    }

    #[test]
    fn a_file_where_a_directory_goes_is_named_so() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("afile");
        std::fs::write(&file, b"x").unwrap();
        let e = check_writable_dir("train.checkpoint_dir", &file).unwrap_err();
        assert_eq!(e.key(), Some("train.checkpoint_dir"));
        assert!(e.to_string().contains("is not a directory"), "{e}");
    }

    #[test]
    fn an_export_over_the_checkpoints_is_refused_however_spelled() {
        let d = tempfile::tempdir().unwrap();
        let run = d.path().join("run");
        for (export, ck) in [
            (run.clone(), run.clone()),
            (run.clone(), run.join("ck")),
            (d.path().join("x/../run/."), run.join("ck")),
        ] {
            let e = check_export_off_checkpoints("train.export_dir", &export, &ck).unwrap_err();
            assert_eq!(e.key(), Some("train.export_dir"), "{export:?}");
            assert!(e.to_string().contains("train.checkpoint_dir"), "{e}");
        }
        check_export_off_checkpoints("train.export_dir", &run.join("export"), &run.join("ck"))
            .unwrap();
        check_export_off_checkpoints("train.export_merged", &run, &d.path().join("ck")).unwrap();
    }
}
