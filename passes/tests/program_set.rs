//! The pass manager verifies every program of the set after every pass: a pass that
//! breaks a server program is caught, the message names the program and the pass, and
//! the last good set is the whole set before that pass.

use distc_ir::{parse, Graph, Op};
use distc_passes::distribute::Distribute;
use distc_passes::{
    run_pipeline, Pass, PassCx, PassError, PassStats, ProgramRole, ProgramSet, Verify,
};

fn program_set() -> ProgramSet {
    let worker = parse(
        r#"graph m {
  %0 = input{name="x"} : f32[4,8]
  %1 = pull{var="w", shards=[0,0,4,1,4,8]} : f32[8,2]
  %2 = matmul %0, %1 : f32[4,2]
  output{name="y"} %2
}"#,
    );
    let server = |s: usize, start: usize, end: usize| {
        parse(&format!(
            r#"graph m.server{s} {{
  %0 = shard{{var="w", start={start}, end={end}, init=zeros}} : f32[4,2]
  serve{{var="w"}} %0
}}"#
        ))
    };
    ProgramSet {
        worker: worker.expect("worker parses"),
        servers: vec![
            server(0, 0, 4).expect("server 0 parses"),
            server(1, 4, 8).expect("server 1 parses"),
        ],
        init: None,
        finalize: None,
        pipeline: None,
        worker_notes: Default::default(),
    }
}

/// A pass that breaks server 1's program: a gradient sink of a variable it lacks.
struct BreakServer;

impl Pass for BreakServer {
    fn run(&self, _: &mut Graph, _: &mut PassCx) -> Result<PassStats, PassError> {
        Err(distc_passes::needs_program_set(&self.name()))
    }

    fn run_programs(&self, p: &mut ProgramSet, _: &mut PassCx) -> Result<PassStats, PassError> {
        let s = &mut p.servers[1];
        let shard = s.node_ids()[0];
        s.add(
            Op::ParamGrad {
                param: "nope".into(),
            },
            vec![shard.into()],
        )?;
        Ok(PassStats::default())
    }
}

/// A worker-only pass, written as every such pass is: `run` alone.
struct CountNodes;

impl Pass for CountNodes {
    fn run(&self, g: &mut Graph, _: &mut PassCx) -> Result<PassStats, PassError> {
        Ok(PassStats::default().count("nodes", g.node_count()))
    }
}

#[test]
fn the_set_verifies() {
    program_set().verify().expect("the test set verifies");
}

#[test]
fn a_broken_server_program_is_caught_and_named() {
    let mut p = program_set();
    let before = p.clone();
    let passes: Vec<Box<dyn Pass>> = vec![Box::new(CountNodes), Box::new(BreakServer)];
    let err = run_pipeline(&mut p, &passes, &mut PassCx::default(), None, |_, _| {})
        .expect_err("the verifier catches the broken server program");
    assert_eq!(err.pass, "break_server");
    assert_eq!(err.programs, [ProgramRole::Server(1)]);
    assert_eq!(
        err.to_string(),
        "after pass break_server: server 1 program: param_grad names `nope`, which is not a variable"
    );
    assert_eq!(
        *err.last_good, before,
        "last_good is the whole set before the pass"
    );
}

/// Verified once at the end (a search's compiles), a broken program is still caught;
/// it is named after the last pass, and no copy of the set was kept.
#[test]
fn verified_at_the_end_a_broken_program_is_still_caught() {
    let passes: Vec<Box<dyn Pass>> = vec![Box::new(BreakServer), Box::new(CountNodes)];
    let mut cx = PassCx {
        verify: Verify::AtEnd,
        ..Default::default()
    };
    let mut p = program_set();
    let err = run_pipeline(&mut p, &passes, &mut cx, None, |_, _| {})
        .expect_err("the verifier at the end catches the broken server program");
    assert_eq!(err.pass, "count_nodes");
    assert_eq!(err.programs, [ProgramRole::Server(1)]);
    assert_eq!(*err.last_good, p, "the set as it was left");
    // A sound pipeline verified at the end keeps the records of every pass.
    let mut p = program_set();
    let records = run_pipeline(
        &mut p,
        &[Box::new(CountNodes) as Box<dyn Pass>],
        &mut cx,
        None,
        |_, _| {},
    )
    .expect("runs");
    assert_eq!(records.len(), 1);
}

#[test]
fn worker_passes_see_the_worker_and_keep_the_rest() {
    let mut p = program_set();
    let before = p.clone();
    let mut seen = Vec::new();
    let passes: Vec<Box<dyn Pass>> = vec![Box::new(CountNodes)];
    let records = run_pipeline(
        &mut p,
        &passes,
        &mut PassCx::default(),
        None,
        |name, set| {
            seen.push((
                name.to_string(),
                set.iter().map(|(r, _)| r).collect::<Vec<_>>(),
            ))
        },
    )
    .expect("runs");
    assert_eq!(records[0].stats.get("nodes"), 4);
    assert_eq!(p, before);
    assert_eq!(
        seen,
        [(
            "count_nodes".to_string(),
            vec![
                ProgramRole::Worker,
                ProgramRole::Server(0),
                ProgramRole::Server(1)
            ]
        )]
    );
}

#[test]
fn set_passes_refuse_one_graph() {
    let mut g = program_set().worker;
    let err = Distribute
        .run(&mut g, &mut PassCx::default())
        .expect_err("distribute needs the set");
    assert!(err.to_string().contains("run_programs"), "{err}");
}

#[test]
fn roles_name_programs_and_files() {
    let names: Vec<(String, String)> = [
        ProgramRole::Worker,
        ProgramRole::Server(2),
        ProgramRole::Init,
        ProgramRole::Final,
    ]
    .iter()
    .map(|r| (r.to_string(), r.file_suffix()))
    .collect();
    assert_eq!(
        names,
        [
            ("worker".into(), "".into()),
            ("server 2".into(), ".server2".into()),
            ("init".into(), ".init".into()),
            ("final".into(), ".final".into()),
        ]
    );
}
