//! The elastic loop as a library, in one process (a job of one): resume, determinism, and
//! refused setups.

use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarBuilder, VarMap};
use rekindle_elastic::train::{self, ElasticOptions, RunEnd, StepOutput, TrainError, Trainer};
use rekindle_runtime::ddp::StepMode;
use rekindle_runtime::optim::{Sgd, SgdConfig};
use rekindle_runtime::sampler::ElasticConfig;

const LEN: usize = 512;

/// A linear model `y = x w` fitted to `y = 3 x0 - 2 x1` on points `x = (i, -i) / LEN`.
struct Setup {
    varmap: VarMap,
    model: candle_nn::Linear,
}

fn setup() -> Setup {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = candle_nn::linear_no_bias(2, 1, vb.pp("fc")).unwrap();
    // Fixed initial weights (candle's own init is not seeded).
    let w = Tensor::new(&[[0.5f32, 0.25]], &Device::Cpu).unwrap();
    varmap.data().lock().unwrap()["fc.weight"].set(&w).unwrap();
    Setup { varmap, model }
}

fn point(i: usize) -> ([f32; 2], f32) {
    let t = i as f32 / LEN as f32;
    let x = [t, 1.0 - t];
    (x, 3.0 * x[0] - 2.0 * x[1])
}

fn trainer(s: &Setup, options: ElasticOptions) -> Trainer {
    let opt = Sgd::new(
        SgdConfig::new(0.5).momentum(0.9),
        train::param_specs(&s.varmap).unwrap(),
    )
    .unwrap();
    let data = ElasticConfig::new(LEN, 32).seed(11);
    Trainer::new(
        train::WorkerEnv::single("unit"),
        s.varmap.clone(),
        Box::new(opt),
        data,
        options,
    )
    .unwrap()
}

fn run(s: &Setup, t: &mut Trainer, steps: u64) -> train::RunSummary {
    let model = s.model.clone();
    t.run(steps, move |input| {
        let (xs, ys): (Vec<[f32; 2]>, Vec<f32>) = input.indices.iter().map(|&i| point(i)).unzip();
        let n = xs.len();
        let flat: Vec<f32> = xs.into_iter().flatten().collect();
        let x = Tensor::from_vec(flat, (n, 2), &Device::Cpu)?;
        let y = Tensor::new(ys, &Device::Cpu)?.unsqueeze(1)?;
        let loss = (model.forward(&x)? - y)?.sqr()?.mean_all()?;
        Ok::<_, candle_core::Error>(
            StepOutput::new(loss.backward()?, input.indices.len())
                .with_loss(loss.to_scalar::<f32>()?),
        )
    })
    .unwrap()
}

fn weights(s: &Setup) -> Vec<f32> {
    s.varmap.data().lock().unwrap()["fc.weight"]
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn options(dir: Option<&std::path::Path>) -> ElasticOptions {
    ElasticOptions {
        checkpoint_dir: dir.map(Into::into),
        checkpoint_every: 10,
        progress: false,
        handle_signals: false,
        ..ElasticOptions::default()
    }
}

#[test]
fn it_learns_and_a_resumed_run_ends_bit_identical() {
    let straight = setup();
    let mut t = trainer(&straight, options(None));
    let summary = run(&straight, &mut t, 40);
    assert_eq!(summary.end, RunEnd::Finished);
    assert_eq!((summary.step, summary.groups_formed), (40, 1));
    let w = weights(&straight);
    // Converging on (3, -2) from (0.5, 0.25).
    assert!(
        (w[0] - 3.0).abs() < 1.0 && (w[1] + 2.0).abs() < 1.0,
        "{w:?}"
    );

    let dir = tempfile::tempdir().unwrap();
    let first = setup();
    let mut t = trainer(&first, options(Some(dir.path())));
    assert_eq!(run(&first, &mut t, 25).last_checkpoint, Some(25));
    let second = setup();
    let mut t = trainer(&second, options(Some(dir.path())));
    assert_eq!(t.step(), 25, "restored at construction");
    let summary = run(&second, &mut t, 40);
    assert_eq!(summary.resumed_from, Some(25));
    assert_eq!(summary.step, 40);
    assert_eq!(weights(&second), w, "resume changes nothing");
}

#[test]
fn setups_that_cannot_recover_are_refused() {
    let s = setup();
    let wrong = Sgd::new(
        SgdConfig::new(0.1),
        vec![rekindle_runtime::optim::ParamSpec::new("other", &[1, 2])],
    )
    .unwrap();
    let err = Trainer::new(
        train::WorkerEnv::single("unit"),
        s.varmap.clone(),
        Box::new(wrong),
        ElasticConfig::new(LEN, 32),
        options(None),
    )
    .unwrap_err();
    assert!(matches!(err, TrainError::Config { .. }), "{err}");

    let mut overlapped = options(None);
    overlapped.ddp.mode = StepMode::Overlapped;
    let opt = Sgd::new(SgdConfig::new(0.1), train::param_specs(&s.varmap).unwrap()).unwrap();
    let err = Trainer::new(
        train::WorkerEnv::single("unit"),
        s.varmap.clone(),
        Box::new(opt),
        ElasticConfig::new(LEN, 32),
        overlapped,
    )
    .unwrap_err();
    assert!(err.to_string().contains("atomic"), "{err}");
}

#[test]
fn a_failing_step_function_is_a_typed_error_naming_the_step() {
    let s = setup();
    let mut t = trainer(&s, options(None));
    let model = s.model.clone();
    let err = t
        .run(
            10,
            |input| -> Result<StepOutput, Box<dyn std::error::Error + Send + Sync>> {
                if input.step == 3 {
                    return Err(std::io::Error::other("data file vanished").into());
                }
                let (x, _) = point(input.indices[0]);
                let loss = model
                    .forward(&Tensor::new(&[x], &Device::Cpu)?)?
                    .sqr()?
                    .mean_all()?;
                Ok(StepOutput::new(loss.backward()?, 1))
            },
        )
        .unwrap_err();
    assert_eq!(t.step(), 3, "the three steps before the failure were taken");
    match err {
        TrainError::Step { step, source, .. } => {
            assert_eq!(step, 3);
            assert!(source.to_string().contains("data file vanished"));
        }
        other => panic!("unexpected {other}"),
    }
}
