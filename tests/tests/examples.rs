//! Every example compiles; the IR after every pass is snapshotted (insta) and
//! round-trips through the text format; the simplified graph computes what the
//! unsimplified one does.

use distc::{compile_file, CompileOptions};
use distc_ir::{parse, print, verify};
use distc_passes::known_pass_names;
use std::path::{Path, PathBuf};

fn examples() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("examples/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "dsl"))
        .collect();
    v.sort();
    v
}

#[test]
fn ir_after_every_pass() {
    let examples = examples();
    assert!(examples.len() >= 6, "examples/ has {} models", examples.len());
    for path in examples {
        let stem = path.file_stem().and_then(|s| s.to_str()).expect("name").to_string();
        for (i, pass) in known_pass_names().iter().enumerate() {
            let opts = CompileOptions {
                stop_after: Some(pass.clone()),
                ..Default::default()
            };
            let c = compile_file(&path, &opts).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            verify(&c.graph).unwrap_or_else(|e| panic!("{stem} after {pass}: {e}"));
            let text = print(&c.graph);
            let back = parse(&text).unwrap_or_else(|e| panic!("{stem} after {pass}: {e}"));
            assert_eq!(back, c.graph, "{stem} after {pass} does not round-trip");
            insta::assert_snapshot!(format!("{stem}__{i}_{pass}"), text);
        }
    }
}

#[test]
fn embedding_gradient_is_indexed_slices() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/lm.dsl");
    let opts = CompileOptions {
        stop_after: Some("autodiff".into()),
        ..Default::default()
    };
    let text = print(&compile_file(&path, &opts).expect("compiles").graph);
    let line = text
        .lines()
        .find(|l| l.contains("embedding_grad"))
        .expect("an embedding_grad node");
    assert!(line.ends_with(": indexed_slices(f32[10000,64], nnz=256)"), "{line}");
}
