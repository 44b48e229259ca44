//! `licm`: loop-invariant pure ops move in front of their loop; loads, integer
//! division and anything depending on the loop stay; results are unchanged.

mod common;

use ejc_ir::interp::{launch_with_stats, Arg};
use ejc_ir::parse::parse_kernel;
use ejc_ir::passes::{Licm, Pass};
use ejc_ir::print::print_kernel;
use ejc_ir::tensor::HostTensor;
use ejc_ir::types::DType;
use ejc_ir::verify::verify;

const LOOP: &str = r#"kernel @licm(%x: tensor<?xf32>, %out: tensor<?xf32>, %n: i32, %d: i32) grid(1, 1, 1) {
  %0 = const 0 : i32
  %1 = const 4 : i32
  %2 = const 0.0 : f32
  %3 = tile.splat %2 {shape = [4]} : tile<4xf32>
  %4 = scf.for %5 = %0 to %n step %1 iter_args(%6 = %3) : tile<4xf32> {
    %7 = tile.arange {len = 4} : tile<4xi32>
    %8 = arith.add %7, %n : tile<4xi32>
    %9 = arith.div %n, %d : i32
    %10 = arith.add %7, %5 : tile<4xi32>
    %11 = tile.load %x[%5 +: 4] {pad = 0.0} : tile<4xf32>
    %12 = cmp.lt %8, %9 : tile<4xi1>
    %13 = scf.if %12 : tile<4xf32> {
      scf.yield %11
    } else {
      %14 = arith.cast %8 {to = f32} : tile<4xf32>
      scf.yield %14
    }
    %15 = arith.add %6, %13 : tile<4xf32>
    scf.yield %15
  }
  tile.store %out[%0 +: 4], %4
}
"#;

#[test]
fn hoists_invariants_and_keeps_the_rest() {
    // %12 (a tile) is not an i1 scalar: make the `if` condition scalar for the test.
    let text = LOOP.replace("%12 = cmp.lt %8, %9 : tile<4xi1>", "%12 = cmp.lt %n, %9 : i1");
    let raw = parse_kernel(&text).unwrap();
    let mut k = raw.clone();
    Licm.run(&mut k);
    verify(&k).unwrap();
    let printed = print_kernel(&k);
    snap!("pass_licm__hoists", printed.clone());
    // The arange, its offset by %n and the cast in the `else` branch move out; the
    // division, the load and everything using the induction variable stay.
    let (before_loop, in_loop) = printed.split_once("scf.for").unwrap();
    assert!(before_loop.contains("tile.arange") && before_loop.contains("arith.cast"), "{printed}");
    assert!(
        in_loop.contains("arith.div") && in_loop.contains("tile.load") && in_loop.contains("arith.add %"),
        "{printed}"
    );

    for (n, d) in [(12.0, 1.0), (12.0, 5.0), (8.0, 100.0)] {
        let run = |k: &ejc_ir::ir::Kernel| {
            let mut args = vec![
                Arg::Tensor(HostTensor::from_vec(DType::F32, &[16], (0..16).map(|i| i as f64 * 0.5).collect())),
                Arg::Tensor(HostTensor::zeros(DType::F32, &[4])),
                Arg::Scalar(n),
                Arg::Scalar(d),
            ];
            let stats = launch_with_stats(k, &mut args, [1, 1, 1]).unwrap();
            (args[1].tensor().unwrap().to_vec(), stats)
        };
        let (want, raw_stats) = run(&raw);
        let (got, opt_stats) = run(&k);
        assert_eq!(got, want, "n={n} d={d}");
        // The arange ran once per iteration before, once after.
        assert_eq!(raw_stats.count("tile.arange"), n as u64 / 4);
        assert_eq!(opt_stats.count("tile.arange"), 1);
    }
}

#[test]
fn nothing_to_hoist_changes_nothing() {
    let text = r#"kernel @k(%x: tensor<?xf32>, %n: i32) grid(1, 1, 1) {
  %0 = const 0 : i32
  %1 = const 1 : i32
  scf.for %2 = %0 to %n step %1 {
    %3 = tile.load %x[%2 +: 4] {pad = 0.0} : tile<4xf32>
    %4 = arith.add %3, %3 : tile<4xf32>
    tile.store %x[%2 +: 4], %4
    scf.yield
  }
}
"#;
    let raw = parse_kernel(text).unwrap();
    let mut k = raw.clone();
    Licm.run(&mut k);
    assert_eq!(print_kernel(&k), print_kernel(&raw));
}
